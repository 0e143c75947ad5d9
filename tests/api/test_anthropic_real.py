"""Anthropic's Messages API (``/v1/messages``) on the real model through the official ``anthropic`` client,
unchanged: whole and streamed answers (the same text as the chat completions route gives the same conversation),
stop sequences, a tool round trip with ``tool_use`` / ``tool_result`` blocks, ``messages.parse`` with a pydantic
model, ``count_tokens``, and bad input in Anthropic's error shape with its SDK's exception types. (The SDK sends
sampling fields only in ``extra_body``: greedy is ``GREEDY``.)"""

from __future__ import annotations

import anthropic
import jsonschema
import openai
import pytest
import requests

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def client(default_server):
    return anthropic.Anthropic(base_url=default_server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_message_is_the_chat_answer_in_anthropic_shape(client, oai, model_name):
    msg = client.messages.create(model=model_name, max_tokens=12, **GREEDY, system="Be brief.", messages=ASK)
    chat = oai.chat.completions.create(
        model=model_name,
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, *ASK],
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    usage = msg.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens


def test_a_streamed_message_gives_the_same_text_and_the_events_in_order(client, model_name):
    whole = client.messages.create(model=model_name, max_tokens=16, **GREEDY, messages=ASK)
    with client.messages.stream(model=model_name, max_tokens=16, **GREEDY, messages=ASK) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(client, model_name):
    free = client.messages.create(model=model_name, max_tokens=24, **GREEDY, messages=ASK).content[0].text
    word = free.split()[2]  # a word the answer writes: it stops there
    msg = client.messages.create(model=model_name, max_tokens=24, **GREEDY, messages=ASK, stop_sequences=[word])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == word
    assert word not in msg.content[0].text and free.startswith(msg.content[0].text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(client, model_name, stream):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=model_name, max_tokens=60, **GREEDY, tools=[WEATHER])
    forced = {"type": "tool", "name": "get_weather"}
    if stream:
        with client.messages.stream(messages=ask, tool_choice=forced, **kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(messages=ask, tool_choice=forced, **kw)
    assert msg.stop_reason == "tool_use"
    (call,) = [b for b in msg.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # the result goes back as a tool_result block; the answer is text again
    turn = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C and sunny"}]},
    ]
    answer = client.messages.create(messages=turn, tool_choice={"type": "none"}, **kw)
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text


def test_any_tool_choice_forces_a_call(client, model_name):
    msg = client.messages.create(
        model=model_name,
        max_tokens=60,
        **GREEDY,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Tell me a joke."}],
    )
    assert [b.type for b in msg.content if b.type == "tool_use"] == ["tool_use"] and msg.stop_reason == "tool_use"


def test_parse_with_a_pydantic_model_follows_its_schema(client, model_name):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    msg = client.messages.parse(model=model_name, max_tokens=40, messages=ASK, output_format=City, **GREEDY)
    assert isinstance(msg.parsed_output, City) and msg.parsed_output.name


def test_count_tokens_is_the_prompt_a_message_computes(client, model_name):
    counted = client.messages.count_tokens(model=model_name, system="Be brief.", messages=ASK, tools=[WEATHER])
    msg = client.messages.create(
        model=model_name, max_tokens=1, system="Be brief.", messages=ASK, tools=[WEATHER], **GREEDY
    )
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 10


@pytest.mark.parametrize(
    ("body", "error", "field"),
    [
        ({"max_tokens": 0, "messages": ASK}, anthropic.BadRequestError, "max_tokens"),
        ({"max_tokens": 5, "messages": []}, anthropic.BadRequestError, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, anthropic.BadRequestError, "role"),
        (
            {"max_tokens": 5, "messages": ASK, "extra_body": {"temperature": 1.5}},
            anthropic.BadRequestError,
            "temperature",
        ),
        (
            {"max_tokens": 5, "messages": ASK, "output_config": {"format": {"type": "xml"}}},
            anthropic.BadRequestError,
            "output_config",
        ),
        (
            {"max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}},
            anthropic.BadRequestError,
            "thinking.budget_tokens must be less than max_tokens",
        ),
        (
            {"max_tokens": 5, "messages": ASK, "extra_body": {"thinking": {"type": "enabled"}}},
            anthropic.BadRequestError,
            "thinking.budget_tokens is required",
        ),
        (
            {"max_tokens": 5, "messages": ASK, "extra_body": {"thinking": {"type": "sometimes"}}},
            anthropic.BadRequestError,
            "thinking",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            anthropic.BadRequestError,
            "image",
        ),
        (
            {"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            anthropic.BadRequestError,
            "built-in",
        ),
        ({"max_tokens": 5, "messages": ASK, "model": "no-such-model"}, anthropic.NotFoundError, "no-such-model"),
    ],
)
def test_bad_input_is_anthropics_error(client, model_name, body, error, field):
    with pytest.raises(error) as info:
        client.messages.create(**{"model": model_name, **body})
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert field in info.value.body["error"]["message"]


def test_errors_outside_the_client_keep_anthropics_shape(default_server, model_name):
    # what the SDK would refuse before sending: max_tokens is required
    response = requests.post(
        default_server.url + "/v1/messages", json={"model": model_name, "messages": ASK}, timeout=10
    )
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens is required" in response.json()["error"]["message"]
    response = requests.post(
        default_server.url + "/v1/messages", data="{", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": response.json()["error"]["message"]},
    }
    assert requests.get(default_server.url + "/v1/messages", timeout=10).json()["type"] == "error"  # 405, same shape
