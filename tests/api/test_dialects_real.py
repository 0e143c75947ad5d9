"""The llama-stack and shortfin dialects on the real model: greedy answers equal the native API's."""

from __future__ import annotations

import json

import requests

PROMPT = "The capital of France is"


def test_llama_stack_completion_matches_native(real_server, model_name, native):
    expected = native(PROMPT, 16)
    body = {"model": model_name, "content": PROMPT, "sampling_params": {"strategy": "greedy", "max_tokens": 16}}
    got = requests.post(real_server.url + "/inference/completion", json=body, timeout=60).json()
    assert got["content"] == expected["text"]
    assert got["stop_reason"] == ("out_of_tokens" if expected["finish_reason"] == "length" else "end_of_turn")


def test_llama_stack_chat_matches_native_chat(real_server, model_name, native):
    expected = native("What is 2 + 2?", 24, chat=True)
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "sampling_params": {"max_tokens": 24},
        "stream": True,
    }
    with requests.post(real_server.url + "/inference/chat_completion", json=body, stream=True, timeout=60) as r:
        events = [json.loads(line)["event"] for line in r.iter_lines() if line]
    assert "".join(e["delta"] for e in events) == expected["text"]


def test_shortfin_generation_matches_native(real_server, native):
    expected = native(PROMPT, 16)
    body = {"text": PROMPT, "sampling_params": {"max_completion_tokens": 16}}
    got = requests.post(real_server.url + "/generate", json=body, timeout=60).json()
    assert got == {"responses": [{"prompt": PROMPT, "responses": [{"text": expected["text"]}]}]}
    ids = requests.post(real_server.url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()["tokens"]
    by_ids = requests.post(
        real_server.url + "/generate",
        timeout=60,
        json={"input_ids": ids, "sampling_params": {"max_completion_tokens": 16}},
    ).json()
    assert by_ids["responses"][0]["responses"][0]["text"] == expected["text"]


def test_tokenize_counts_equal_usage(real_server, model_name, oai):
    for prompt in (PROMPT, "naïve café — 東京"):
        usage = oai.completions.create(model=model_name, prompt=prompt, max_tokens=1).usage
        tok = requests.post(
            real_server.url + "/tokenize", json={"model": model_name, "prompt": prompt}, timeout=10
        ).json()
        assert tok["count"] == usage.prompt_tokens == len(tok["tokens"])
        tgi = requests.post(real_server.url + "/tokenize", json={"inputs": prompt}, timeout=10).json()
        assert [t["id"] for t in tgi] == tok["tokens"] and tgi[-1]["stop"] == len(prompt)
        assert all(t["text"] == prompt[t["start"] : t["stop"]] for t in tgi)  # byte tokens share a character
        assert (
            requests.post(real_server.url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=10).json()["prompt"]
            == prompt
        )
    messages = [{"role": "user", "content": "hi there"}]
    usage = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=1).usage
    assert (
        requests.post(real_server.url + "/tokenize", json={"messages": messages}, timeout=10).json()["count"]
        == usage.prompt_tokens
    )


def test_min_tokens_and_stop_token_ids(real_server, model_name, oai):
    """min_tokens holds the end token off; stop_token_ids ends the answer at a chosen token."""
    ids = requests.post(
        real_server.url + "/generate",
        timeout=60,
        json={"text": "Say OK.", "sampling_params": {"max_completion_tokens": 40}, "return_input_ids": True},
    ).json()
    held = oai.completions.create(
        model=model_name, prompt="Say OK.", max_tokens=40, temperature=0, extra_body={"min_tokens": 40}
    )
    assert len(ids) < 40 and held.usage.completion_tokens == 40  # it would end sooner on its own
    first_new = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    cut = oai.completions.create(
        model=model_name,
        prompt="Say OK.",
        max_tokens=40,
        temperature=0,
        extra_body={"stop_token_ids": [ids[first_new]]},
    )
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == first_new + 1
