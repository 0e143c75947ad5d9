"""The text-generation client against the real model: greedy parity with the native API, streaming, stop,
seed, validation errors, /info and the raw TGI formats."""

from __future__ import annotations

import asyncio
import json

import pytest
import requests
from text_generation import AsyncClient, Client
from text_generation.errors import ValidationError

PROMPT = "The three primary colors are"
N = 12


@pytest.fixture(scope="module")
def tgi(real_server):
    return Client(real_server.url, timeout=60)


def test_generate_greedy_matches_native(tgi, native):
    ref = native(PROMPT, N)
    out = tgi.generate(PROMPT, max_new_tokens=N)
    assert out.generated_text == ref["text"]
    details = out.details
    assert details.generated_tokens == ref["completion_tokens"] == len(details.tokens)
    assert (
        details.finish_reason.value
        == {"length": "length", "stop": "stop_sequence", "eos": "eos_token"}[ref["finish_reason"]]
    )
    assert details.seed is None and details.prefill == []
    assert "".join(t.text for t in details.tokens if not t.special) == out.generated_text
    assert all(t.logprob is not None and t.logprob <= 0 for t in details.tokens)


def test_generate_stream_concatenates_to_generate(tgi):
    full = tgi.generate(PROMPT, max_new_tokens=N)
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=N))
    assert "".join(e.token.text for e in events if not e.token.special) == full.generated_text
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    last = events[-1]
    assert last.generated_text == full.generated_text
    assert last.details.generated_tokens == full.details.generated_tokens
    assert last.details.finish_reason == full.details.finish_reason
    assert last.token.id == full.details.tokens[-1].id


def test_stop_sequence_cuts_exactly(tgi):
    free = tgi.generate(PROMPT, max_new_tokens=N).generated_text
    stop = free.strip().split()[1][:3]
    out = tgi.generate(PROMPT, max_new_tokens=N, stop_sequences=[stop])
    assert out.generated_text == free[: free.index(stop)]
    assert out.details.finish_reason.value == "stop_sequence"
    last = list(tgi.generate_stream(PROMPT, max_new_tokens=N, stop_sequences=[stop]))[-1]
    assert last.generated_text == out.generated_text


def test_seed_reproduces_sampling_and_is_reported(tgi):
    a = tgi.generate("Once upon a time", max_new_tokens=8, do_sample=True, temperature=1.0, seed=7)
    b = tgi.generate("Once upon a time", max_new_tokens=8, do_sample=True, temperature=1.0, seed=7)
    assert a.generated_text == b.generated_text and a.details.seed == 7
    streamed = list(tgi.generate_stream("Once upon a time", max_new_tokens=8, do_sample=True, seed=7))
    assert streamed[-1].generated_text == a.generated_text
    unseeded = tgi.generate("Once upon a time", max_new_tokens=2, do_sample=True)
    assert isinstance(unseeded.details.seed, int)


def test_return_full_text_and_truncate(tgi):
    plain = tgi.generate(PROMPT, max_new_tokens=3)
    full = tgi.generate(PROMPT, max_new_tokens=3, return_full_text=True)
    assert full.generated_text == PROMPT + plain.generated_text
    short = tgi.generate("ignored words " + PROMPT, max_new_tokens=3, truncate=5)
    assert short.details.generated_tokens == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"watermark": True},
        {"do_sample": True, "best_of": 2},
        {"typical_p": 0.5},
        {"top_n_tokens": 3},
        {"decoder_input_details": True},
        {"max_new_tokens": 5000},
        {"temperature": 200.0},
    ],
)
def test_unsupported_or_bad_parameters_raise_validation_error(tgi, kwargs):
    with pytest.raises(ValidationError):
        tgi.generate(PROMPT, **{"max_new_tokens": 2, **kwargs})


def test_stream_validation_error(tgi):
    with pytest.raises(ValidationError):
        list(tgi.generate_stream(PROMPT, max_new_tokens=2, watermark=True))


def test_raw_generate_and_errors(real_server):
    url = real_server.url
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
    out = requests.post(url + "/generate", json=body, timeout=60).json()
    assert set(out) == {"generated_text"}  # details only when asked for
    compat = requests.post(url + "/", json=body, timeout=60).json()
    assert compat == [out]
    bad = requests.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"mirostat": 1}}, timeout=10)
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation" and "mirostat" in bad.json()["error"]
    empty = requests.post(url + "/generate_stream", json={"inputs": ""}, timeout=10)
    assert empty.status_code == 422 and set(empty.json()) == {"error", "error_type"}


def test_raw_generate_stream_events(real_server, sse_data):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}}
    events = [
        json.loads(d) for d in sse_data(requests.post(real_server.url + "/generate_stream", json=body, timeout=60))
    ]
    assert all(set(e) >= {"index", "token", "generated_text", "details"} for e in events)
    assert all(set(e["token"]) == {"id", "text", "logprob", "special"} for e in events)
    assert events[-1]["details"] == {"finish_reason": "length", "generated_tokens": 4, "seed": None}
    assert events[-1]["index"] == 4


def test_info(real_server, model_name):
    info = requests.get(real_server.url + "/info", timeout=10).json()
    assert info["model_id"] == model_name and info["max_total_tokens"] == 1024
    assert info["max_input_tokens"] < info["max_total_tokens"] and info["max_best_of"] == 1


def test_async_client(real_server, tgi):
    async def run():
        client = AsyncClient(real_server.url, timeout=60)
        out = await client.generate(PROMPT, max_new_tokens=4)
        parts = [e.token.text async for e in client.generate_stream(PROMPT, max_new_tokens=4) if not e.token.special]
        return out.generated_text, "".join(parts)

    generated, streamed = asyncio.run(run())
    assert generated == streamed == tgi.generate(PROMPT, max_new_tokens=4).generated_text
