"""LoRA adapters over HTTP, on a real server of the tiny llama (tests/data/lora/base-q8_0.gguf) with two adapters
loaded at start (--lora: a GGUF from llama.cpp's converter and a PEFT folder), through the JWT proxy with the
official openai client: each adapter a model name of its own and ``base:name``, llama-server's per-request
``lora`` list with scales, greedy answers as llama-server gives them, rows of different adapters and of none in
one step each answering as alone, and vLLM's runtime load and unload for operators alone. The engine's side:
tests/engine/test_lora.py."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
from servers import MODEL_CACHE, ServerProcess, team_token

DATA = Path(__file__).resolve().parent.parent / "data" / "lora"
REF = json.loads((DATA / "llamacpp.json").read_text())
BASE = "base-q8_0"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(
        "--model",
        str(DATA / f"{BASE}.gguf"),
        "--lora",
        f"qv={DATA / 'qv.gguf'}",
        "--lora",
        f"mlp={DATA / 'mlp'}",  # the PEFT folder
        "--model-cache-dir",
        MODEL_CACHE,
        "--context-length",
        "128",
        "--cache-ram",
        "0",
    ) as server:
        yield server


def greedy(client, model: str, ids: list[int], **extra) -> list[str]:
    """The greedy answer's tokens (their text) to a prompt of token ids."""
    r = client.completions.create(
        model=model, prompt=ids, max_tokens=REF["n_predict"], temperature=0, logprobs=0, extra_body=extra
    )
    return r.choices[0].logprobs.tokens


def llama_cpp_first(server, lora: list, headers: dict | None = None) -> list[str]:
    """llama-server's first greedy token for each prompt under these adapters, as text (this server's
    detokenizer)."""
    case = next(c for c in REF["cases"] if c["lora"] == lora)
    return [
        requests.post(server.url + "/detokenize", json={"tokens": t[:1]}, headers=headers, timeout=30).json()["prompt"]
        for t in case["tokens"]
    ]


def agree(ours: list[list[str]], first: list[str]) -> int:
    """On how many prompts the first tokens agree."""
    return sum(bool(a) and a[0] == b for a, b in zip(ours, first))


def test_adapters_are_model_names(client):
    cards = {m.id: m for m in client.models.list()}
    assert {BASE, "qv", "mlp"} <= cards.keys()
    assert cards["qv"].parent == BASE and cards["mlp"].status["lora"]["rank"] == 4  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "model, extra, lora",
    [
        ("qv", {}, [["qv", 1.0]]),
        (f"{BASE}:mlp", {}, [["mlp", 1.0]]),
        (BASE, {"lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.7}]}, [["qv", 1.0], ["mlp", 0.7]]),
        (BASE, {}, []),
    ],
)
def test_greedy_answers_agree_with_llama_server(client, server, model, extra, lora):
    ours = [greedy(client, model, ids, **extra) for ids in REF["prompt_ids"]]
    assert agree(ours, llama_cpp_first(server, lora)) >= 10  # the bar: 10 of 12


def test_rows_of_different_adapters_share_steps_and_answer_as_alone(client):
    jobs = [(m, ids) for ids in REF["prompt_ids"][:4] for m in (BASE, "qv", "mlp")]
    alone = [greedy(client, m, ids) for m, ids in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: greedy(client, *job), jobs))
    assert together == alone
    assert len({tuple(a) for a in alone[:3]}) == 3  # the adapters change the answer


def test_bad_adapter_requests_get_clear_errors(client):
    ids = REF["prompt_ids"][0]
    with pytest.raises(openai.NotFoundError, match="has no LoRA adapter 'nope'"):
        greedy(client, f"{BASE}:nope", ids)
    with pytest.raises(openai.BadRequestError, match=r"lora\[0\].id 5 is not one of"):
        greedy(client, BASE, ids, lora=[{"id": 5}])
    with pytest.raises(openai.BadRequestError, match="one of id and name"):
        greedy(client, BASE, ids, lora=[{"scale": 1}])


def test_runtime_load_and_unload_are_for_operators(client, proxy):
    team = {"Authorization": f"Bearer {team_token()}"}
    admin = {"Authorization": f"Bearer {team_token(team_id='ops', admin=True)}"}
    body = {"lora_name": "all7", "lora_path": str(DATA / "all7.gguf")}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert requests.post(proxy.url + path, json=body, headers=team, timeout=30).status_code == 403
    assert requests.get(proxy.url + "/lora-adapters", headers=team, timeout=30).status_code == 403
    r = requests.post(proxy.url + "/v1/load_lora_adapter", json=body, headers=admin, timeout=60)
    assert r.status_code == 200 and "all7" in r.text
    listed = requests.get(proxy.url + "/lora-adapters", headers=admin, timeout=30).json()
    assert [a["name"] for a in listed] == ["qv", "mlp", "all7"] and listed[2]["id"] == 2
    for scale in (1.0, 0.5):  # the adapter loaded at run time answers as llama-server's, at either scale
        ours = [greedy(client, BASE, ids, lora=[{"name": "all7", "scale": scale}]) for ids in REF["prompt_ids"]]
        assert agree(ours, llama_cpp_first(proxy, [["all7", scale]], admin)) >= 10
    ids = REF["prompt_ids"][1]
    assert greedy(client, "all7", ids) == greedy(client, BASE, ids, lora=[{"name": "all7"}])
    bad = {"lora_name": "broken", "lora_path": str(DATA / "llamacpp.json")}
    r = requests.post(proxy.url + "/v1/load_lora_adapter", json=bad, headers=admin, timeout=60)
    assert r.status_code == 400 and "llamacpp.json" in r.json()["error"]["message"]
    r = requests.post(proxy.url + "/v1/unload_lora_adapter", json={"lora_name": "all7"}, headers=admin, timeout=60)
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        greedy(client, "all7", ids)
    r = requests.post(proxy.url + "/v1/unload_lora_adapter", json={"lora_name": "all7"}, headers=admin, timeout=60)
    assert r.status_code == 404


def test_bench_spreads_streams_over_adapters(server):
    import re
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[2] / "scripts" / "bench.py"
    argv = [sys.executable, str(bench), "--url", server.url, "--api", "openai", "--concurrency", "4"]
    result = subprocess.run(
        [*argv, "--max-tokens", "6", "--ignore-eos", "--adapters", "qv", "mlp"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"c=4\s+adapters [\d.]+, base [\d.]+ tokens/s: [\d.]+x", result.stdout), result.stdout


def test_an_adapter_loaded_at_run_time_survives_an_engine_restart(client, server):
    import os
    import signal

    from servers import wait_for

    body = {"lora_name": "kept", "lora_path": str(DATA / "all7")}  # the PEFT folder
    assert requests.post(server.url + "/v1/load_lora_adapter", json=body, timeout=60).status_code == 200
    ids = REF["prompt_ids"][2]
    before = greedy(client, "kept", ids)
    engine = server.health()["backend_pid"]
    os.kill(engine, signal.SIGKILL)

    def restarted() -> bool:
        h = requests.get(server.url + "/health", timeout=10).json()
        return h["status"] == "ready" and h["backend_pid"] not in (None, engine)

    assert wait_for(restarted, 120)
    assert greedy(client, "kept", ids) == before
    assert "kept" in [m.id for m in client.models.list()]
