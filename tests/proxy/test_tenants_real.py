"""Tenants against each other, as a determined team would try, through the JWT proxy in front of the real model
(the shared default server): one team's prompts never show in another's cached tokens or time to first token,
another team's long prompts never starve a short request, a request costs what it takes (``n``), work is bounded
before it is validated, operator data needs an operator's token, and a victim's greedy answer is token for
token the same beside all of it (docs/security.md lists each attack with its test)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from proxy_helpers import bearer, make_token, start_proxy
from servers import wait_for

SECRET_PROMPT = "My SSN is 987-65-4321, keep it secret. Reply with one short sentence that does not repeat it."


@pytest.fixture(scope="module")
def tenants(default_server):
    with start_proxy(default_server.url) as proxy:
        yield proxy.url, default_server


def team(name: str, **claims) -> dict[str, str]:
    return bearer(make_token({"team_id": name, "token_id": f"{name}-key", **claims}))


def complete(url: str, headers: dict, model: str, prompt: str, **body) -> requests.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **body}
    return requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)


def cached(r: requests.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def first_token_seconds(url: str, headers: dict, model: str, prompt: str, **body) -> float:
    """Seconds from sending a streamed completion to its first text."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, **body}
    started = time.perf_counter()
    with requests.post(f"{url}/v1/completions", json=body, headers=headers, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                return time.perf_counter() - started
    raise AssertionError("no token")


def test_no_team_finds_another_teams_prompt_in_the_prefix_cache(tenants, model_name):
    """Team B guesses the token after a known prefix of team A's prompt (the probe that recovered an SSN in 197
    tries): no guess, the right one included, finds a cached token, while team A's row still holds its prompt and
    after it is freed; the same prompt sent again by team A reuses its own cache, with another cache_salt it
    does not. Team A's request is a long stream, read after the probes to show it was still in its row: a freed
    row is the next request's (the lowest free row is taken), so a request that ended early would prove nothing."""
    url, server = tenants
    a, b = team("team-a"), team("team-b")
    known = "My SSN is 987-65-"
    server.wait_idle()
    body = {"model": model_name, "prompt": SECRET_PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with requests.post(f"{url}/v1/completions", json=body, headers=a, stream=True, timeout=300) as holding:
        assert holding.status_code == 200, holding.text
        events = (line for line in holding.iter_lines() if line.startswith(b"data: "))
        assert next(events).startswith(b"data: {")  # team A's prompt is in its row, decoding
        for guess in ["4321", "1234", "0000"]:  # each in a namespace of its own: only A's rows could answer
            probe = f"{known}{guess}, keep it secret. filler"
            assert cached(complete(url, b, model_name, probe, cache_salt=f"probe-{guess}")) == 0
        assert cached(complete(url, b, model_name, SECRET_PROMPT)) == 0
        assert cached(complete(url, a, model_name, SECRET_PROMPT, cache_salt="other")) == 0
        assert cached(complete(url, a, model_name, SECRET_PROMPT)) > 10  # the team's own reuse stays
        still = [json.loads(next(events)[6:])["choices"][0]["finish_reason"] for _ in range(3)]
        assert still == [None] * 3, still  # A's stream had not ended: its row held the prompt throughout
    server.wait_idle()  # the stream closed: its row is free, its cache kept
    assert cached(complete(url, team("team-c"), model_name, SECRET_PROMPT)) == 0  # A's rows are free now


def prefix_hits(server) -> float:
    """The engine's count of prompt tokens found in the prefix cache and reused, not computed again."""
    text = requests.get(server.url + "/metrics", timeout=10).text
    return next(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "inference_prefix_cache_hits_total"
    )


def test_the_time_to_first_token_tells_no_team_what_another_cached(tenants, model_name):
    """A long prompt of team A, sent again by A, comes back at once (its own cache); sent by other teams, each
    computes it in full. The time to first token is the prompt tokens computed, so the engine's own count of the
    tokens it reused tells it, whatever the load: A's repeats reuse all of the prompt but its last token, the
    other teams' reuse none."""
    url, server = tenants
    a = team("team-ttft-a")
    prompt = "Confidential memo. " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(120))
    first = complete(url, a, model_name, prompt)  # computed in full: A's rows hold it now
    assert first.status_code == 200, first.text
    length = first.json()["usage"]["prompt_tokens"]
    before = prefix_hits(server)
    own = [first_token_seconds(url, a, model_name, prompt) for _ in range(3)]
    reused_by_a = prefix_hits(server) - before
    others = [first_token_seconds(url, team(f"team-ttft-{i}"), model_name, prompt) for i in range(3)]
    reused_by_others = prefix_hits(server) - before - reused_by_a
    print(f"first token after (s): team A {own}, other teams {others}")
    assert reused_by_a == 3 * (length - 1) and reused_by_others == 0, (length, reused_by_a, reused_by_others)


def test_a_short_request_is_not_starved_by_another_teams_long_prompts(tenants, model_name):
    """Six long prompts of team B start first (the rows below the victim's); team A's short request, sent while
    they are being computed, ends before any of them: it shares the next step's prompt chunk."""
    url, server = tenants
    b, a = team("team-flood"), team("team-short")
    long_prompt = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    ended: dict[str, float] = {}

    def flood(i: int) -> None:
        r = complete(url, b, model_name, f"{i} {long_prompt}", max_tokens=1)
        assert r.status_code == 200, r.text
        ended[f"flood-{i}"] = time.perf_counter()

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    assert wait_for(lambda: server.health()["rows_in_use"] >= 6, 60, 0.02), server.health()
    r = complete(url, a, model_name, "Name a color.", max_tokens=2)
    ended["short"] = time.perf_counter()
    for t in threads:
        t.join(300)
    assert r.status_code == 200, r.text
    assert len(ended) == 7
    assert ended["short"] < min(v for k, v in ended.items() if k != "short"), ended


def test_n_counts_toward_the_teams_open_rows(tenants, model_name):
    """A request with n choices takes n of the team's 16 places at the proxy: two of n=8 fill them, a third is a
    429 and n=17 alone a 400, while another team is served."""
    url, server = tenants
    c = team("team-n")
    body = {"n": 8, "max_tokens": 300, "ignore_eos": True, "temperature": 0.8, "seed": 1}
    with ThreadPoolExecutor(2) as pool:
        holding = [pool.submit(complete, url, c, model_name, "Tell a story.", **body) for _ in range(2)]
        # both hold their 8 rows
        assert wait_for(lambda: server.health()["rows_in_use"] >= 16, 60, 0.02), server.health()
        refused = complete(url, c, model_name, "Tell a story.", n=2)
        assert refused.status_code == 429, refused.text
        assert refused.headers.get("Retry-After")
        assert complete(url, c, model_name, "Hi", n=17).status_code == 400
        assert complete(url, team("team-other"), model_name, "Hi").status_code == 200
        assert all(f.result().status_code == 200 for f in holding)


def test_work_is_bounded_before_validation(tenants, model_name):
    """A prompt longer than any context could take is refused before it is tokenized, on every path; a schema
    llguidance cannot match from its first token is a 400 before the request takes a row."""
    url, _ = tenants
    a = team("team-big")
    huge = "word " * 40_000  # 200 KB: over 64 characters per token of the tests' 1024-token context
    r = complete(url, a, model_name, huge)
    assert r.status_code == 400 and "characters long" in r.json()["error"]["message"]
    chat = {"model": model_name, "messages": [{"role": "user", "content": huge}], "max_tokens": 1}
    assert requests.post(f"{url}/v1/chat/completions", json=chat, headers=a, timeout=60).status_code == 400
    tokenize = {"model": model_name, "messages": [{"role": "user", "content": huge}]}
    assert requests.post(f"{url}/tokenize", json=tokenize, headers=a, timeout=60).status_code == 400
    props = {f"p{i}": {"type": "string"} for i in range(2000)}
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": {"type": "object", "properties": props}}}
    r = complete(url, a, model_name, "Fill in:", max_tokens=5, response_format=fmt)
    assert r.status_code == 400 and "grammar" in r.json()["error"]["message"], r.text


def test_operator_data_needs_an_operators_token(tenants):
    url, _ = tenants
    assert requests.get(f"{url}/metrics", headers=team("team-a"), timeout=30).status_code == 403
    assert requests.get(f"{url}/health", headers=team("team-a"), timeout=30).json().keys() == {"status"}
    admin = team("ops", admin=True)
    assert "inference_http_requests" in requests.get(f"{url}/metrics", headers=admin, timeout=30).text
    assert "model" in requests.get(f"{url}/health", headers=admin, timeout=30).json()


def test_a_victims_answer_is_the_same_beside_every_other_teams_attack(tenants, model_name, tmp_path):
    """The isolation test through the proxy: team A's greedy answer alone equals its answer while other teams
    probe its prompt in the prefix cache, fork n choices, salt their cache, flood long prompts, send grammars,
    oversized prompts, sample hot, draft tokens for speculative decoding (and opt out of it), decode with a LoRA
    adapter loaded at run time (by its model name and by llama-server's lora list), and speak the Responses and
    Messages APIs; and team A's stored response stays
    its own while another team tries to read, continue and delete it."""
    url, _ = tenants
    a = team("team-victim")
    victim = {"max_tokens": 30, "ignore_eos": True, "logprobs": 0}
    prompt = "Write two sentences about the history of the violin."

    def tokens(headers: dict, text: str, **body) -> list[str]:
        r = complete(url, headers, model_name, text, **body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    alone = tokens(a, prompt, **victim)
    attacks = [
        (team("team-x"), prompt, {"max_tokens": 1}),  # probes the victim's prompt
        (team("team-x"), prompt[:20] + " cello", {"max_tokens": 1}),
        (team("team-y"), "Tell me a story.", {"n": 4, "max_tokens": 30, "temperature": 1.5, "seed": 3}),
        (team("team-y"), prompt, {"cache_salt": "mine", "max_tokens": 10, "temperature": 1.2, "seed": 9}),
        (team("team-z"), "word " * 700, {"max_tokens": 2}),
        (team("team-z"), "JSON please:", {"max_tokens": 12, "response_format": {"type": "json_object"}}),
        (team("team-z"), "word " * 40_000, {}),  # refused before tokenizing
        # rows that draft and have their drafts checked in the victim's steps (speculative decoding), and one that
        # opts out
        (team("team-s"), "Repeat exactly: " + "the violin has four strings; " * 12, {"max_tokens": 40}),
        (team("team-s"), "Copy: " + "a b c d e f g " * 10, {"max_tokens": 30, "speculative": False}),
    ]

    stored = requests.post(
        f"{url}/v1/responses",
        json={"model": model_name, "input": prompt, "max_output_tokens": 4, "temperature": 0},
        headers=a,
        timeout=120,
    ).json()
    at = f"/v1/responses/{stored['id']}"
    x = team("team-x")
    other_apis = [  # (headers, path, body): the agent APIs beside the victim, and a probe of its stored response
        (x, "/v1/responses", {"model": model_name, "input": prompt, "max_output_tokens": 8, "temperature": 1.5}),
        (x, "/v1/messages", {"model": model_name, "max_tokens": 8, "messages": [{"role": "user", "content": prompt}]}),
        (x, "/v1/responses", {"model": model_name, "input": "?", "previous_response_id": stored["id"]}),
    ]

    def attack(args) -> None:
        headers, text, body = args
        assert complete(url, headers, body.pop("model", model_name), text, **body).status_code in (200, 400), text

    def call(args) -> int:
        headers, path, body = args
        return requests.post(url + path, json=body, headers=headers, timeout=300).status_code

    admin = team("ops", admin=True)
    adapter = {"lora_name": "tenant-lora", "lora_path": str(random_adapter(tmp_path))}
    loaded = requests.post(f"{url}/v1/load_lora_adapter", json=adapter, headers=admin, timeout=120)
    assert loaded.status_code == 200, loaded.text
    attacks += [  # rows with a LoRA adapter decode in the victim's steps (its model name, and llama-server's list)
        (team("team-l"), "Tell me about the violin.", {"max_tokens": 30, "model": "tenant-lora"}),
        (team("team-l"), prompt, {"max_tokens": 20, "lora": [{"name": "tenant-lora", "scale": 2.0}]}),
    ]

    with ThreadPoolExecutor(1 + len(attacks) + len(other_apis)) as pool:
        others = [pool.submit(attack, x) for x in attacks]
        apis = [pool.submit(call, x) for x in other_apis]
        beside = pool.submit(tokens, a, prompt, **victim)
        assert beside.result() == alone
        for o in others:
            o.result()
        assert [f.result() for f in apis] == [200, 200, 404]  # another team's stored response: not found
    for method in ("GET", "DELETE"):
        assert requests.request(method, url + at, headers=x, timeout=60).status_code == 404
    kept = requests.get(url + at, headers=a, timeout=60)
    assert kept.status_code == 200 and kept.json()["output"] == stored["output"]
    unloaded = requests.post(
        f"{url}/v1/unload_lora_adapter", json={"lora_name": "tenant-lora"}, headers=admin, timeout=60
    )
    assert unloaded.status_code == 200 and tokens(a, prompt, **victim) == alone


def random_adapter(folder: Path) -> Path:
    """A PEFT LoRA folder for the embedded SmolLM2-135M (30 layers, hidden 576, 3 key/value heads of 64) with
    random weights large enough to change its answers, on q_proj, v_proj and down_proj."""
    import torch
    from safetensors.torch import save_file

    gen, r = torch.Generator().manual_seed(7), 8
    shapes = {"self_attn.q_proj": (576, 576), "self_attn.v_proj": (576, 192), "mlp.down_proj": (1536, 576)}
    tensors = {}
    for layer in range(30):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen) * 0.05
    out = folder / "tenant-lora"
    out.mkdir()
    save_file(tensors, out / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
