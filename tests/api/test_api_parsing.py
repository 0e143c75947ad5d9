"""Request parsing and stream building without a server: every rejected field is named, defaults are right."""

from __future__ import annotations

import json

import pytest

from inference_api.engine.messages import EngineReady, FinishReason, TokenEvent
from inference_api.request_errors import RequestError
from inference_api.web.dialects.openai.format import ChatFormat, stream_chunks
from inference_api.web.dialects.openai.protocol import parse_chat, parse_completion
from inference_api.web.dialects.tgi.protocol import parse_tgi

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def rejects(parse, body: dict, param: str) -> str:
    with pytest.raises(RequestError) as info:
        parse(body)
    assert info.value.kind == "invalid" and info.value.field == param, info.value.message
    return info.value.message


def test_chat_defaults():
    req = parse_chat(dict(CHAT), 100)
    assert req.params.temperature == 1.0 and req.params.top_p == 1.0 and req.params.logprobs is None
    assert req.params.max_tokens is None and not req.stream and not req.include_usage
    assert req.messages == ({"role": "user", "content": "hi"},)


def test_chat_maps_parameters():
    req = parse_chat(
        {
            **CHAT,
            "temperature": 0,
            "stop": "\n",
            "seed": 3,
            "logprobs": True,
            "top_logprobs": 2,
            "max_completion_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
        },
        100,
    )
    assert (req.params.temperature, req.params.stop, req.params.seed, req.params.logprobs) == (0, ("\n",), 3, 2)
    assert req.params.max_tokens == 7 and req.max_tokens_field == "max_completion_tokens" and req.include_usage
    assert req.messages == ({"role": "system", "content": "a\nb"},)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 9}, "n"),
        ({"n": 0}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"stop": [""]}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        ({"model": 5}, "model"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_format": "html"}, "reasoning_format"),
        ({"thinking_budget_tokens": -1}, "thinking_budget_tokens"),
        ({"thinking_budget_tokens": 2.5}, "thinking_budget_tokens"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_chat_rejections_name_the_field(extra, param):
    rejects(lambda b: parse_chat(b, 100), {**CHAT, **extra}, param)


def test_completion_prompts():
    assert parse_completion({"model": "m", "prompt": ["hi"]}, 100).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": [[1, 2]]}, 100).prompt_ids == (1, 2)
    assert parse_completion({"model": "m", "prompt": "x", "logprobs": 0, "echo": False}, 100).params.logprobs == 0
    for prompt in ("", [], ["a", "b"], [1, 100], [[1], [2]], {"a": 1}, None):
        rejects(lambda b: parse_completion(b, 100), {"model": "m", "prompt": prompt}, "prompt")


def test_tgi_greedy_unless_sampling():
    assert parse_tgi({"inputs": "x"}, 64).params.temperature == 0
    assert parse_tgi({"inputs": "x", "parameters": {"temperature": 1.0}}, 64).params.temperature == 0
    sampled = parse_tgi({"inputs": "x", "parameters": {"top_k": 5}}, 64)
    assert sampled.params.temperature == 1.0 and sampled.params.top_k == 5 and sampled.seed is not None
    seeded = parse_tgi({"inputs": "x", "parameters": {"do_sample": True, "seed": 9, "stop": []}}, 64)
    assert seeded.seed == 9 and seeded.params.stop == ()


@pytest.mark.parametrize(
    "params, param",
    [
        ({"watermark": True}, "watermark"),
        ({"best_of": 2}, "best_of"),
        ({"typical_p": 0.9}, "typical_p"),
        ({"temperature": 0}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"truncate": 65}, "truncate"),
        ({"seed": -1}, "seed"),
        ({"stop": ["a"] * 9}, "stop"),
        ({"grammar": {"type": "regex"}}, "grammar"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"adapter": 1}, "adapter"),
    ],
)
def test_tgi_rejections_name_the_field(params, param):
    rejects(lambda b: parse_tgi(b, 64), {"inputs": "x", "parameters": params}, param)


def test_stream_error_after_start_is_an_error_event_and_ends_the_stream():
    ready = EngineReady("", "m", 64, 10, "cpu", "float32")
    events = [TokenEvent("s", "Hel", (1,)), TokenEvent("s", "", finish_reason=FinishReason.ERROR, error="boom")]
    chunks = [c.decode() for c in stream_chunks(ChatFormat(ready, False), iter(events), 3, True)]
    assert json.loads(chunks[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(chunks[1][6:])["choices"][0]["delta"] == {"content": "Hel"}
    assert json.loads(chunks[2][6:]) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": None}
    }
    assert len(chunks) == 3  # no [DONE]: the stream did not complete


def test_n_and_echo():
    req = parse_completion({"model": "m", "prompt": "x", "n": 8, "echo": True, "logprobs": 3}, 100)
    assert (req.params.n, req.echo, req.params.prompt_logprobs) == (8, True, 3)  # echo with logprobs: the prompt's
    req = parse_completion({"model": "m", "prompt": "x", "echo": True}, 100)
    assert (req.params.n, req.echo, req.params.prompt_logprobs) == (1, True, None)
    assert parse_chat({**CHAT, "n": "4"}, 100).params.n == 4
    rejects(lambda b: parse_completion(b, 100), {"model": "m", "prompt": "x", "echo": 1}, "echo")
    req = parse_completion({"model": "m", "prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": 4}, 100)
    assert (req.prompt_logprobs, req.params.prompt_logprobs) == (4, 4)  # vLLM's field; both from one prefill
    assert parse_completion({"model": "m", "prompt": "x", "prompt_logprobs": 0}, 100).params.prompt_logprobs == 0
    rejects(lambda b: parse_completion(b, 100), {"model": "m", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs")


def test_n_choices_stream_tagged_with_their_index_and_usage_sums_them():
    ready = EngineReady("", "m", 64, 10, "cpu", "float32")
    events = [
        TokenEvent("s", "A", (1,), completion_tokens=1),
        TokenEvent("s", "B", (2,), index=1, completion_tokens=1),
        TokenEvent("s", "", (3,), finish_reason=FinishReason.EOS, completion_tokens=2, index=1),
        TokenEvent("s", "a", (4,), finish_reason=FinishReason.LENGTH, completion_tokens=2),
    ]
    body = [c.decode()[6:].strip() for c in stream_chunks(ChatFormat(ready, False), iter(events), 3, True, n=2)]
    assert body[-1] == "[DONE]"
    chunks = [json.loads(c) for c in body[:-1]]
    assert [
        (c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]
    ] == [
        (0, {"role": "assistant", "content": ""}, None),
        (1, {"role": "assistant", "content": ""}, None),
        (0, {"content": "A"}, None),
        (1, {"content": "B"}, None),
        (1, {}, "stop"),
        (0, {"content": "a"}, None),
        (0, {}, "length"),
    ]
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["usage"]["prompt_tokens"] == 3


def test_chat_thinking_fields():
    from inference_api.request.reasoning import Thinking

    assert parse_chat(dict(CHAT), 100).thinking == Thinking(split=True, budget=None)
    assert parse_chat({**CHAT, "thinking_budget_tokens": 5}, 100).thinking.budget == 5
    assert parse_chat({**CHAT, "reasoning_effort": "none"}, 100).thinking.budget == 0
    assert parse_chat({**CHAT, "reasoning_effort": "high"}, 100).thinking.budget is None  # the server's
    assert parse_chat({**CHAT, "reasoning_format": "none"}, 100).thinking.split is False


def test_reasoning_parser_follows_the_chat_template():
    from inference_api.request.reasoning import PARSERS, choose_parser

    chatml = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    qwen3 = chatml + "{% if '</think>' in x %}{% endif %}<|im_start|>assistant\n<think>\n"
    r1 = "{{'<｜Assistant｜>'}}{% set c = content.split('</think>')[-1] %}"
    assert choose_parser("auto", chatml) is None and choose_parser("auto", None) is None
    assert choose_parser("auto", qwen3) is PARSERS["qwen3"]
    assert choose_parser("auto", r1) is PARSERS["deepseek_r1"]
    assert choose_parser("qwen3", chatml) is PARSERS["qwen3"]  # the flag wins
    assert choose_parser("none", qwen3) is None
