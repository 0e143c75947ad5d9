"""The native API with the real default model: greedy equivalence under load, stops, seeds, disconnects."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from greedy import JOBS, MAX_TOKENS, SUBJECTS, assert_greedy_equivalent, served_answers
from servers import native, wait_for


@pytest.mark.parametrize("mode", ["exact", "quantized"])
def test_forty_concurrent_greedy_requests_match_generate_alone(mode, request, model_name, reference):
    """More requests than rows: some wait; each output still equals the model's output for it alone. The
    quantized server holds the GGUF's own 4-bit blocks, whose dequantized values the reference runs."""
    real_server = request.getfixturevalue("real_server" if mode == "exact" else "quantized_server")
    health = real_server.health()
    assert health["quantize"] == ("none" if mode == "exact" else "int4")
    texts = served_answers(real_server, model_name, JOBS, stream=True)
    assert len(set(texts)) > 30  # distinct prompts, distinct answers: nothing mixed or duplicated
    for (prompt, chat), text in zip(JOBS, texts):
        assert_greedy_equivalent(text, prompt, chat, reference)
    assert real_server.wait_idle()["open_sessions"] == 0


def answer(server, model_name, chat: bool = False, **body) -> dict:
    """The native route's non-streaming answer (through the chat template when ``chat``)."""
    r = native(server, model_name, {"stream": False, **body}, chat=chat, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_sequence_spanning_tokens_cuts_exactly(real_server, model_name, reference):
    prompt = "Here is a short story about the sea:"
    full = answer(real_server, model_name, text=prompt, temperature=0, max_tokens=MAX_TOKENS)["text"]
    ref_ids, _, _ = reference(prompt, False)
    pieces = [reference.tokenizer.decode(ref_ids[:i], skip_special_tokens=True) for i in range(len(ref_ids) + 1)]
    # a stop string that starts inside one token and ends inside a later one
    start = len(pieces[2]) - 2
    stop = full[start : len(pieces[4]) - 1]
    assert len(stop) >= 3
    body = {"text": prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "stop_sequence": [stop]}
    r = native(real_server, model_name, body, stream=True, timeout=120)
    streamed = b"".join(r.raw.read_chunked(decode_content=False)).decode("utf-8")
    assert streamed == full[: full.index(stop)]
    result = answer(real_server, model_name, text=prompt, temperature=0, max_tokens=MAX_TOKENS, stop_sequence=stop)
    assert result["text"] == streamed and result["finish_reason"] == "stop"


def test_seed_reproduces_sampled_output(real_server, model_name):
    body = dict(text="Tell me something surprising.", temperature=1.0, top_k=50, top_p=0.95, max_tokens=16)
    a = answer(real_server, model_name, seed=1234, **body)["text"]
    b = answer(real_server, model_name, seed=1234, **body)["text"]
    others = {answer(real_server, model_name, seed=s, **body)["text"] for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1


def test_non_streaming_reports_counts_and_reason(real_server, model_name, hf_tokenizer):
    prompt = "Count: one, two, three,"
    result = answer(real_server, model_name, text=prompt, temperature=0, max_tokens=5)
    assert result["finish_reason"] == "length" and result["completion_tokens"] == 5
    assert result["prompt_tokens"] == len(hf_tokenizer.encode(prompt))
    chat = answer(real_server, model_name, chat=True, text="What is the capital of France?", temperature=0)
    assert "Paris" in chat["text"] and chat["finish_reason"] == "eos"


def test_prompt_plus_max_tokens_must_fit_the_context(real_server, model_name):
    r = native(real_server, model_name, {"text": "word " * 600, "max_tokens": 600})
    assert r.status_code == 400 and "context" in r.json()["message"]


def test_disconnect_frees_the_row(real_server, model_name):
    real_server.wait_idle()
    # greedy through the chat template: hundreds of tokens, never an early end token (sampling could end it at once)
    essay = {"text": "Write a very long essay about rivers.", "max_tokens": 900, "temperature": 0}
    r = native(real_server, model_name, essay, chat=True, stream=True, timeout=60)
    next(r.iter_content(chunk_size=None))
    assert real_server.health()["rows_in_use"] == 1
    r.close()
    started = time.monotonic()
    health = real_server.wait_idle(timeout=10)
    assert health["rows_in_use"] == 0 and health["open_sessions"] == 0
    print(f"row freed {time.monotonic() - started:.2f}s after the disconnect")


def test_a_prompt_sent_again_beside_a_running_stream_leaves_both_answers_intact(quantized_server, model_name):
    """The second time a prompt comes, its row still holds all of it but the last token, so its prefill is
    one token; with another stream decoding in row 0 that token must go to its own row (it once went to
    row 0: a wrong answer, and a corrupted position in the other stream's cache)."""
    server = quantized_server
    server.wait_idle()

    def complete(prompt: str, max_tokens: int) -> str:
        body = {"model": model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        r = requests.post(f"{server.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    essay, story = "Write a long essay about rivers and the sea.", "Here is a short story about a lighthouse:"
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(complete, essay, 400)  # row 0, 400 steps
        assert wait_for(lambda: server.health()["rows_in_use"], 60, 0.02)
        first = complete(story, MAX_TOKENS)  # row 1
        again = complete(story, MAX_TOKENS)  # row 1 again, one token left to compute
        assert not running.done()  # 42 steps against 400: the essay was decoding all along
        beside = running.result()
    assert again == first
    assert complete(essay, 400) == beside  # alone now: the same answer, so its cache was never touched


def test_the_same_prompt_gives_the_same_answer_whatever_the_load(default_server, model_name):
    """The default mode is batch-invariant: 24 prompts with shared prefixes, each sent twice among 48 requests
    at once (more than the 32 rows: some wait, and many start after a prefix another row computed), answer token
    for token as each prompt sent alone."""
    server = default_server
    health = server.health()
    assert health["int8_inputs"] is True and health["kernels"] == "native"  # the set-up step built them for this CPU
    prefixes = (
        "You are a careful assistant. Answer in one plain sentence, with no list. ",
        "Here is a question from a quiz for children, and its short answer. ",
    )
    prompts = [
        f"{prefix}Question {i}: what is special about {subject}?"
        for prefix in prefixes
        for i, subject in enumerate(SUBJECTS[:12])
    ]

    def complete(prompt: str) -> list[int]:
        body = {
            "model": model_name,
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
        }
        r = requests.post(f"{server.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    with ThreadPoolExecutor(2 * len(prompts)) as pool:
        together = list(pool.map(complete, prompts + prompts))
    alone = [complete(p) for p in prompts]
    assert len({tuple(a) for a in alone}) > 20
    differ = [i for i, t in enumerate(together) if t != alone[i % len(prompts)]]
    assert not differ, f"{len(differ)} of {len(together)} answers under load part from the prompt alone"
    assert server.wait_idle()["open_sessions"] == 0


def test_a_victims_answer_alone_equals_its_answer_beside_adversarial_requests(default_server, model_name):
    """Per-row isolation in the default mode: a greedy request answers token for token as it does alone while
    other requests in the same steps sample hot with seeds, carry penalties, log-probs, stop strings, min_tokens
    and ignore_eos, end after one token, or push long prompts through chunked prefill; and a seeded hot sampler
    without truncation draws the same tokens beside rows whose top_p or top_k sort their candidates or vocabulary."""
    server = default_server

    def complete(body: dict) -> list[str]:
        r = requests.post(f"{server.url}/v1/completions", json={"model": model_name, **body}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"] if body.get("logprobs") is not None else []

    victim = {
        "prompt": "Write two sentences about the history of the violin.",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    # a seeded hot sampler without truncation draws over its whole vocabulary in token order, whatever the
    # truncation (sorted candidates, or a sorted vocabulary) of the rows beside it
    sampler = {"prompt": "Name a colour.", "max_tokens": 24, "temperature": 1.3, "seed": 21, "logprobs": 0}
    alone, sampled_alone = complete(victim), complete(sampler)
    adversaries = [
        {"prompt": "Tell me a story.", "max_tokens": 40, "temperature": 1.8, "top_p": 1.0, "seed": 7},
        {
            "prompt": "List fruits:",
            "max_tokens": 40,
            "temperature": 0.9,
            "repetition_penalty": 1.9,
            "frequency_penalty": 2.0,
            "presence_penalty": 2.0,
            "seed": 3,
            "logprobs": 5,
        },
        {"prompt": "Count: one, two,", "max_tokens": 40, "temperature": 0, "stop": [",", " "], "min_tokens": 30},
        {"prompt": "Hi", "max_tokens": 1, "temperature": 0},
        {"prompt": "word " * 700, "max_tokens": 8, "temperature": 0.5, "ignore_eos": True},
        {
            "prompt": "Write two sentences about the history of the violin. No,",
            "max_tokens": 40,
            "temperature": 0,
            "min_p": 0.2,
            "top_k": 3,
        },
        {"prompt": "Tell me a story.", "max_tokens": 24, "temperature": 1.0, "top_p": 0.9, "seed": 11},
        {"prompt": "Tell me a joke.", "max_tokens": 24, "temperature": 1.2, "top_k": 300, "seed": 5},
    ]
    with ThreadPoolExecutor(2 + 2 * len(adversaries)) as pool:
        others = [pool.submit(complete, a) for a in adversaries * 2]
        beside, sampled_beside = pool.submit(complete, victim), pool.submit(complete, sampler)
        assert beside.result() == alone
        assert sampled_beside.result() == sampled_alone
        for o in others:
            o.result()
    assert server.wait_idle()["open_sessions"] == 0


def test_the_web_processes_of_a_gguf_hold_neither_torch_nor_transformers_tokenizer(default_server, model_name):
    """The server's first process (gunicorn's arbiter) and its web worker never load torch (neither pre-flight's
    checks nor the engine's entry point import it; a GGUF's tokenizer and chat template are read without
    transformers, which would load it), after chat, tool, structured, log-prob and tokenize requests have taken
    the web worker's paths: libtorch is not mapped in either, and the worker holds under 0.2 GB."""
    tool = {"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {}}}}
    bodies = [
        {"messages": [{"role": "user", "content": "Say hello."}], "logprobs": True, "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "Weather?"}], "tools": [tool], "tool_choice": "required"},
        {"messages": [{"role": "user", "content": "A name"}], "response_format": {"type": "json_object"}},
    ]
    for body in bodies:
        r = requests.post(
            default_server.url + "/v1/chat/completions", json={"model": model_name, "max_tokens": 8, **body}, timeout=60
        )
        assert r.status_code == 200, r.text
    assert requests.post(default_server.url + "/tokenize", json={"inputs": "hello"}, timeout=30).status_code == 200
    engine = default_server.health()["backend_pid"]
    worker = int(Path(f"/proc/{engine}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1]) == default_server.proc.pid
    for pid in (default_server.proc.pid, worker):
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), pid
    assert "libtorch" in Path(f"/proc/{engine}/maps").read_text()  # (what the check looks for is there to find)
    status = Path(f"/proc/{worker}/status").read_text().splitlines()
    rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    assert rss_kb < 200 * 1024
