"""Tool calling on the real model (SmolLM2, whose chat template ignores tools: it is shown them in the system
message) through the openai client, and huggingface_hub's InferenceClient on the same server: a forced call
(``required``, a named function) always parses and matches its tool's schema, streamed or not."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from inference_api.request.tools import plain_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llama_stack(default_server):
    import httpx
    import llama_stack_client

    return llama_stack_client.LlamaStackClient(
        base_url=default_server.url, max_retries=0, http_client=httpx.Client(timeout=120)
    )


def create(client, model, stream=False, **fields):
    """(content, calls as (id, name, arguments object), finish_reason), streamed or not."""
    fields = {"messages": ASK, "tools": TOOLS, "max_tokens": 60, "temperature": 0, **fields}
    if not stream:
        choice = client.chat.completions.create(model=model, **fields).choices[0]
        calls = [(c.id, c.function.name, arguments(c.function.arguments)) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(model=model, stream=True, **fields):
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        if delta.content:
            content = (content or "") + delta.content
        for c in delta.tool_calls or []:
            if c.id is not None:  # a call opens with its id, type and name, its arguments empty
                assert c.index not in calls and c.type == "function" and c.function.arguments == ""
                calls[c.index] = [c.id, c.function.name, ""]
            else:
                calls[c.index][2] += c.function.arguments
    assert list(calls) == list(range(len(calls)))
    return content, [(i, n, arguments(a)) for i, n, a in calls.values()], finish


def arguments(text: str):
    """A call's arguments (the text as it is when max_tokens cut it short)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def valid(calls, names=tuple(SCHEMAS)) -> bool:
    for _, name, arguments in calls:
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])
    return bool(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_calls_always_match_their_schema(client, model_name, stream):
    content, calls, finish = create(client, model_name, stream, tool_choice="required")
    assert valid(calls) and content is None and finish == "tool_calls"
    assert calls[0][0].startswith("call_")
    named = {"type": "function", "function": {"name": "add"}}
    content, calls, finish = create(client, model_name, stream, tool_choice=named, parallel_tool_calls=False)
    assert valid(calls, ("add",)) and len(calls) == 1 and content is None and finish == "tool_calls"


def test_streamed_and_whole_answers_agree(client, model_name):
    """Also when max_tokens cuts a forced call short: a call, its arguments as far as they got, 'length'."""
    for choice in ("required", "auto"):
        whole, streamed = (
            create(client, model_name, stream, tool_choice=choice, max_tokens=30) for stream in (False, True)
        )
        assert (whole[0], [c[1:] for c in whole[1]], whole[2]) == (
            streamed[0],
            [c[1:] for c in streamed[1]],
            streamed[2],
        )


def test_auto_and_none(client, model_name):
    content, calls, finish = create(client, model_name, tool_choice="auto", max_tokens=30)
    assert (calls and valid(calls) and finish == "tool_calls") or (content and finish in ("stop", "length"))
    content, calls, finish = create(client, model_name, tool_choice="none", max_tokens=8)
    assert content and not calls and finish == "length"
    plain = client.chat.completions.create(model=model_name, messages=ASK, max_tokens=8, temperature=0)
    assert plain.choices[0].message.content == content  # none: the tools are not shown


def test_a_tool_result_round_trip(client, model_name, hf_tokenizer):
    first = client.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0
    )
    message = first.choices[0].message
    history = ASK + [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"celsius": 21}'},
    ]
    final = client.chat.completions.create(
        model=model_name, messages=history, tools=TOOLS, max_tokens=30, temperature=0
    )
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    call = message.tool_calls[0].function
    shown = plain_messages(
        ASK
        + [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": call.name, "arguments": json.loads(call.arguments)}}],
            },
            {"role": "tool", "content": '{"celsius": 21}'},
        ],
        TOOLS,
    )
    assert final.usage.prompt_tokens == len(hf_tokenizer.encode_chat(shown))


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tools": openai.NOT_GIVEN, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tools_are_400_naming_the_field(client, model_name, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, model_name, **fields)
    assert info.value.body["param"] == param


def test_huggingface_inference_client(default_server, model_name):
    """huggingface_hub's InferenceClient given the server's URL, unchanged (it sends the model name 'dummy')."""
    from huggingface_hub import InferenceClient

    hf = InferenceClient(base_url=default_server.url, timeout=120)
    out = hf.text_generation("The capital of France is", max_new_tokens=4, details=True)
    assert out.details.generated_tokens == len(out.details.tokens) == 4
    assert "".join(t.text for t in out.details.tokens) == out.generated_text
    streamed = list(hf.text_generation("The capital of France is", max_new_tokens=4, stream=True, details=True))
    assert "".join(s.token.text for s in streamed) == out.generated_text
    assert streamed[-1].details.finish_reason == "length"

    chat = hf.chat_completion(ASK, max_tokens=6, temperature=0)
    assert chat.model == model_name and chat.choices[0].finish_reason == "length"
    pieces = [
        c.choices[0].delta.content
        for c in hf.chat_completion(ASK, max_tokens=6, temperature=0, stream=True)
        if c.choices
    ]
    assert "".join(p for p in pieces if p) == chat.choices[0].message.content

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    shaped = hf.chat_completion(
        ASK,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    jsonschema.validate(json.loads(shaped.choices[0].message.content), schema)

    called = hf.chat_completion(ASK, max_tokens=60, temperature=0, tools=TOOLS, tool_choice="required")
    assert called.choices[0].finish_reason == "tool_calls"
    fn = called.choices[0].message.tool_calls[0].function
    jsonschema.validate(json.loads(fn.arguments), SCHEMAS[fn.name])
    deltas = [
        c.choices[0].delta
        for c in hf.chat_completion(ASK, max_tokens=60, temperature=0, tools=TOOLS, tool_choice="required", stream=True)
        if c.choices
    ]
    opened = [d.tool_calls[0] for d in deltas if d.tool_calls and d.tool_calls[0].id]
    assert opened and opened[0].function.name == fn.name


def test_llama_stack_tools(llama_stack, model_name):
    """llama-stack's chat with ToolDefinitions: a required call answered as its ToolCall, whole and streamed, and
    the tool's result sent back as an ipython message."""
    tools = [
        {
            "tool_name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {"city": {"param_type": "str"}, "days": {"param_type": "int", "required": False}},
        }
    ]
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fields = forced_call(model_name, tools, 60)
    message = llama_stack.inference.chat_completion(**fields).completion_message
    assert message.stop_reason == "end_of_message" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.tool_name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(call.arguments, schema)
    events = [c.event for c in llama_stack.inference.chat_completion(**fields, stream=True)]
    streamed = [e.delta.content for e in events if e.event_type == "progress" and not isinstance(e.delta, str)]
    assert [(c.tool_name, c.arguments) for c in streamed] == [(call.tool_name, call.arguments)]
    assert events[-1].stop_reason == "end_of_message"
    history = ASK + [
        {"role": "assistant", "content": "", "stop_reason": "end_of_message", "tool_calls": [call.model_dump()]},
        {"role": "ipython", "call_id": call.call_id, "tool_name": call.tool_name, "content": "21 C"},
    ]
    final = llama_stack.inference.chat_completion(
        model=model_name, messages=history, tools=tools, sampling_params={"strategy": "greedy", "max_tokens": 20}
    )
    assert final.completion_message.stop_reason in ("end_of_turn", "out_of_tokens", "end_of_message")


def test_tokenize_shows_the_tools_as_a_chat_request_does(default_server, client, model_name):
    """vLLM's /tokenize with messages and tools counts the prompt a chat request with those tools is given."""
    import requests

    tok = requests.post(
        default_server.url + "/tokenize", json={"model": model_name, "messages": ASK, "tools": TOOLS}, timeout=30
    ).json()
    bare = requests.post(default_server.url + "/tokenize", json={"messages": ASK}, timeout=30).json()
    chat = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, max_tokens=1, temperature=0)
    assert tok["count"] == chat.usage.prompt_tokens > bare["count"]
    for body, param in (
        ({"prompt": "hi", "tools": TOOLS}, "tools"),
        ({"messages": ASK, "tools": [{"type": "function"}]}, "tools[0]"),
    ):
        bad = requests.post(default_server.url + "/tokenize", json=body, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param


def test_openai_legacy_functions_point_to_tools(client, model_name):
    legacy = [{"name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    for fields in ({"functions": legacy}, {"function_call": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model_name, messages=ASK, max_tokens=4, **fields)
        assert info.value.body["param"] == next(iter(fields)) and "tools" in info.value.body["message"]


def forced_call(model_name: str, tools: list[dict], max_tokens: int) -> dict:
    """A llama-stack chat completion of ASK that must call one of the tools, greedy."""
    return {
        "model": model_name,
        "messages": ASK,
        "tools": tools,
        "tool_choice": "required",
        "sampling_params": {"strategy": "greedy", "max_tokens": max_tokens},
    }


def test_llama_stack_forced_call_cut_short_is_failed_text(llama_stack, model_name):
    """A required call cut off by max_tokens does not parse into a ToolCall: as llama-stack's server gives it,
    text (the answer's content; in a stream, a tool-call delta with parse_status failure) and out_of_tokens."""
    tools = [{"tool_name": "get_weather", "parameters": {"city": {"param_type": "str"}}}]
    fields = forced_call(model_name, tools, 8)
    message = llama_stack.inference.chat_completion(**fields).completion_message
    assert message.stop_reason == "out_of_tokens" and not message.tool_calls
    assert message.content.startswith("<tool_call>")
    events = [c.event for c in llama_stack.inference.chat_completion(**fields, stream=True)]
    failed = [e.delta for e in events if e.event_type == "progress" and not isinstance(e.delta, str)]
    assert [(d.parse_status, d.content.strip()) for d in failed] == [("failure", message.content)]
    assert events[-1].stop_reason == "out_of_tokens"
