"""The official openai client against the real model: greedy parity with the native API, usage, stop, seed,
streaming format, errors."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import requests

PROMPT = "The three primary colors are"
QUESTION = "What is the capital of France?"
N = 12  # max_tokens: short answers keep the suite fast on a CPU


def test_models_list_and_retrieve(oai, model_name, real_server):
    assert [m.id for m in oai.models.list()] == [model_name]
    assert oai.models.retrieve(model_name).owned_by
    body = requests.get(real_server.url + "/v1/models", timeout=10).json()
    assert body["object"] == "list" and body["data"][0]["object"] == "model"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")


def test_completion_greedy_matches_native_with_tokenizer_usage(oai, model_name, native, hf_tokenizer):
    ref = native(PROMPT, N)
    out = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=N, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == model_name
    choice = out.choices[0]
    assert choice.index == 0 and choice.text == ref["text"]
    assert choice.finish_reason == {"length": "length", "stop": "stop", "eos": "stop"}[ref["finish_reason"]]
    assert out.usage.prompt_tokens == len(hf_tokenizer.encode(PROMPT)) == ref["prompt_tokens"]
    assert out.usage.completion_tokens == ref["completion_tokens"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(oai, model_name, real_server):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: at most a shared beginning the first time a prompt
    comes; all but its last token when it comes again (the last is always computed: its logits give the first
    answer token)."""
    real_server.wait_idle()
    prompt = "A prompt this test alone sends: list four kinds of cloud."
    first = oai.completions.create(model=model_name, prompt=prompt, max_tokens=3, temperature=0).usage
    again = oai.completions.create(model=model_name, prompt=prompt, max_tokens=3, temperature=0).usage
    assert first.prompt_tokens_details.cached_tokens < first.prompt_tokens // 2
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens - 1 == first.prompt_tokens - 1


def test_completion_prompt_as_token_ids(oai, model_name, hf_tokenizer):
    ids = hf_tokenizer.encode(PROMPT)
    by_text = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids = oai.completions.create(model=model_name, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)


def test_chat_greedy_matches_native_predictions(oai, model_name, native, hf_tokenizer):
    ref = native(QUESTION, N, chat=True)
    messages = [{"role": "user", "content": QUESTION}]
    out = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=N, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref["text"]
    assert out.usage.prompt_tokens == len(hf_tokenizer.encode_chat(messages)) == ref["prompt_tokens"]
    assert out.usage.completion_tokens == ref["completion_tokens"]


def test_chat_template_covers_every_turn_and_text_parts(oai, model_name, hf_tokenizer):
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": [{"type": "text", "text": "Name a color."}]},
    ]
    out = oai.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=3, temperature=0)
    flat = messages[:3] + [{"role": "user", "content": "Name a color."}]
    assert out.usage.prompt_tokens == len(hf_tokenizer.encode_chat(flat))
    assert out.usage.completion_tokens <= 3


def test_chat_stream_concatenates_to_the_full_answer(oai, model_name):
    messages = [{"role": "user", "content": QUESTION}]
    full = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=N, temperature=0)
    chunks = list(
        oai.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens - 1  # asked again
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_sse_format(real_server, model_name, sse_data):
    body = {
        "model": model_name,
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = requests.post(real_server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    data = sse_data(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" and "system_fingerprint" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    # without include_usage: no usage field and no usage chunk
    body.pop("stream_options")
    plain = [
        json.loads(d) for d in sse_data(requests.post(real_server.url + "/v1/completions", json=body, timeout=60))[:-1]
    ]
    assert all("usage" not in c and c["choices"] for c in plain)
    assert "".join(c["choices"][0]["text"] for c in plain) == "".join(c["choices"][0]["text"] for c in chunks[:-1])


def test_stop_cuts_exactly_where_the_stop_string_starts(oai, model_name):
    free = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=N, temperature=0).choices[0].text
    stop = free.strip().split()[1][:3]  # a piece of the second word: matches mid-output, maybe mid-token
    cut = free.index(stop)
    out = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop, "@@@"])
    assert out.choices[0].text == free[:cut] and out.choices[0].finish_reason == "stop"
    streamed = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=N, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == free[:cut]


def test_seed_reproduces_sampled_output(oai, model_name):
    kwargs = dict(
        model=model_name,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=8,
        temperature=1.0,
        seed=4242,
    )
    first = oai.chat.completions.create(**kwargs).choices[0].message.content
    assert oai.chat.completions.create(**kwargs).choices[0].message.content == first
    streamed = oai.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == first


def test_logprobs(oai, model_name):
    chat = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)  # greedy
    comp = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == 0 and all(v <= 0 for v in lp.token_logprobs)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"n": 9}, "n"),
        ({"temperature": 2.5}, "temperature"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"stop": list("abcdefghi")}, "stop"),  # over the default 8
        ({"max_tokens": 5000}, "max_tokens"),
        ({"extra_body": {"mirostat": 1}}, "mirostat"),
        ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_chat_parameters_raise_bad_request_naming_them(oai, model_name, kwargs, param):
    kwargs = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model_name, **kwargs)
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"echo": "yes"}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 6}, "logprobs"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"suffix": "end"}, "suffix"),
    ],
)
def test_bad_completion_parameters_raise_bad_request(oai, model_name, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=model_name, **{"prompt": "hi", "max_tokens": 2, **kwargs})
    assert info.value.body["param"] == param


def test_unknown_model_is_404_model_not_found(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.code == "model_not_found"


def test_harmless_client_fields_are_accepted(oai, model_name):
    out = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi", "name": "ann"}],
        max_tokens=2,
        user="u-1",
        metadata={"k": "v"},
        store=False,
        n=1,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        top_p=0.9,
    )
    assert out.usage.completion_tokens <= 2


def test_async_client_stream_equals_non_stream(real_server, model_name):
    from openai import AsyncOpenAI

    async def run() -> tuple[str, str]:
        async with AsyncOpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0) as client:
            kwargs = dict(
                model=model_name, messages=[{"role": "user", "content": QUESTION}], max_tokens=6, temperature=0
            )
            full = await client.chat.completions.create(**kwargs)
            parts = [
                c.choices[0].delta.content or ""
                async for c in await client.chat.completions.create(**kwargs, stream=True)
            ]
            return full.choices[0].message.content, "".join(parts)

    full, streamed = asyncio.run(run())
    assert full == streamed and full
