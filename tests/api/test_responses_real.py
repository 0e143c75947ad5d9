"""OpenAI's Responses API (``/v1/responses``) on the real model through the official ``openai`` client, unchanged:
whole and streamed responses (the chat route's answer to the same conversation), ``incomplete_details`` at
``max_output_tokens``, a function-call round trip, ``responses.parse`` with a pydantic model, multi-turn by
``previous_response_id``, ``retrieve`` and ``delete``, stored responses private to their team, and bad input as
OpenAI's errors."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from inference_api.web.dialects.responses.store import ResponseStore

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def as_team(client, team: str):
    return client.with_options(default_headers={"X-Team-Id": team})


def test_a_response_is_the_chat_answer(client, model_name):
    resp = client.responses.create(
        model=model_name, input=QUESTION, instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(
        model=model_name,
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
    )
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == model_name
    assert resp.output_text == chat.choices[0].message.content
    assert [item.type for item in resp.output] == ["message"]
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":  # 12 tokens: it is cut
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.instructions == "Be brief." and resp.max_output_tokens == 12


SHORT = "What is 2+2?"  # answered within 16 tokens: the client's stream helper needs a response.completed


def test_a_streamed_response_gives_the_same_text_and_the_events_in_order(client, model_name):
    whole = client.responses.create(model=model_name, input=SHORT, max_output_tokens=16, temperature=0)
    assert whole.status == "completed"
    events = list(
        client.responses.create(model=model_name, input=SHORT, max_output_tokens=16, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    # the openai client's own stream helper reads the same events
    with client.responses.stream(model=model_name, input=SHORT, max_output_tokens=16, temperature=0) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_round_trip(client, model_name, stream):
    kw = dict(model=model_name, temperature=0, max_output_tokens=60, tools=[WEATHER])
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "name": "get_weather"}
    if stream:
        with client.responses.stream(input=ask, tool_choice=forced, **kw) as s:
            resp = s.get_final_response()
    else:
        resp = client.responses.create(input=ask, tool_choice=forced, **kw)
    (call,) = [item for item in resp.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    turn = [
        *ask,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"},
    ]
    answer = client.responses.create(input=turn, tool_choice="none", **kw)
    assert [item.type for item in answer.output] == ["message"] and answer.output_text


def test_parse_with_a_pydantic_model_follows_its_schema(client, model_name):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    resp = client.responses.parse(
        model=model_name, input=QUESTION, text_format=City, max_output_tokens=40, temperature=0
    )
    assert isinstance(resp.output_parsed, City) and resp.output_parsed.name


def test_previous_response_id_continues_the_conversation_and_delete_forgets_it(client, model_name):
    first = client.responses.create(model=model_name, input="My name is Ada.", max_output_tokens=8, temperature=0)
    second = client.responses.create(
        model=model_name, input="What is my name?", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    alone = client.responses.create(model=model_name, input="What is my name?", max_output_tokens=8, temperature=0)
    # the second turn's prompt holds the first turn and its answer
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)  # (the client returns nothing)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=model_name, input="Again?", previous_response_id=first.id, max_output_tokens=4)
    assert info.value.body["param"] == "previous_response_id"


def test_a_stored_response_is_private_to_its_team(client, model_name):
    a, b = as_team(client, "team-a"), as_team(client, "team-b")
    mine = a.responses.create(model=model_name, input="A secret: 42.", max_output_tokens=4, temperature=0)
    assert a.responses.retrieve(mine.id).id == mine.id
    for call in (
        lambda: b.responses.retrieve(mine.id),
        lambda: b.responses.delete(mine.id),
        lambda: b.responses.create(model=model_name, input="?", previous_response_id=mine.id, max_output_tokens=4),
        lambda: client.responses.retrieve(mine.id),  # no team is not team-a either
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert a.responses.retrieve(mine.id).id == mine.id  # b's delete did nothing
    unstored = a.responses.create(model=model_name, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)


def test_the_store_is_bounded_in_count_and_age():
    now = [0.0]
    store = ResponseStore(max_items=2, max_seconds=60, clock=lambda: now[0])
    for i in range(3):
        store.put("t", {"id": f"r{i}"}, ())
    assert store.get("t", "r0") is None and store.get("t", "r2") is not None and len(store) == 2
    now[0] = 61
    assert store.get("t", "r2") is None and len(store) == 0
    store.put("t", {"id": "x"}, ())
    assert store.get("u", "x") is None and not store.delete("u", "x") and store.delete("t", "x")
    assert len(ResponseStore(0, 60)) == 0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
def test_bad_input_is_openais_error(client, model_name, fields, param):
    body = {"model": model_name, "input": QUESTION, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            **{k: v for k, v in body.items() if k in ("model", "input")},
            extra_body={k: v for k, v in body.items() if k not in ("model", "input")},
        )
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["param"] == param


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input=QUESTION)
