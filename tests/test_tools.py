"""Tool calling without a model (inference_api/request/tools.py): tools and tool_choice checked, the grammar a forced
call gets, what a template without tools is shown, the calls parsed from text whole and streamed."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from inference_api.engine.messages import EngineReady, FinishReason
from inference_api.request.generation import Generation
from inference_api.request.prepare import Prompt, encode
from inference_api.request.tools import CallSplitter, parse_tools, plain_messages, split_calls
from inference_api.request_errors import RequestError
from inference_api.web.dialects.openai.protocol import parse_chat
from inference_api.web.dialects.openai.tool_format import ToolChatFormat

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages[0].tool_calls",
        ),
    ],
)
def test_bad_tools_name_the_field(fields, param):
    with pytest.raises(RequestError) as info:
        parse_chat({**CHAT, **fields}, 100)
    assert info.value.field == param, info.value


def test_tool_choices():
    assert parse_chat(CHAT, 100).tools is None and parse_chat({**CHAT, "tool_choice": "none"}, 100).tools is None
    auto = parse_chat({**CHAT, "tools": [WEATHER, NOW]}, 100)
    assert auto.tools.choice == "auto" and auto.tools.offered and auto.params.grammar is None
    assert not parse_chat({**CHAT, "tools": [WEATHER], "tool_choice": "none"}, 100).tools.offered
    named = parse_chat(
        {**CHAT, "tools": [WEATHER, NOW], "tool_choice": {"type": "function", "function": {"name": "now"}}}, 100
    )
    assert (named.tools.choice, named.tools.name) == ("function", "now") and named.params.grammar is not None
    # TGI's forms: a named choice without its type, or the bare name
    for tgi in ({"function": {"name": "now"}}, "now"):
        assert parse_chat({**CHAT, "tools": [WEATHER, NOW], "tool_choice": tgi}, 100).tools.name == "now"
    # a tool without parameters takes none
    assert named.tools.tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}


def accepts(tools, text: str) -> bool:
    """Whether the grammar a forced choice imposes takes ``text`` whole (llguidance's byte-level vocabulary)."""
    from llguidance import LLTokenizer

    matcher = LLMatcher(LLTokenizer("byte"), tools.grammar().llguidance(), log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def test_the_forced_grammar_accepts_calls_and_nothing_else():
    required = parse_tools([WEATHER, NOW], "required", None)
    single = parse_tools([WEATHER, NOW], "required", False)
    named = parse_tools([WEATHER, NOW], {"type": "function", "function": {"name": "now"}}, None)
    two = call("get_weather", {"city": "Oslo"}) + call("now", {})
    assert accepts(required, call("get_weather", {"city": "Oslo"})) and accepts(required, two)
    assert not accepts(single, two) and accepts(single, call("now", {}))
    assert not accepts(required, call("get_weather", {})) and not accepts(required, "Hello")  # city is required
    assert not accepts(named, call("get_weather", {"city": "Oslo"})) and accepts(named, call("now", {}))
    assert parse_tools([WEATHER], "auto", None).grammar() is None


def test_calls_are_parsed_whole_and_streamed_alike():
    text = "Let me look.\n" + call("get_weather", {"city": "Oslo"}) + call("now", {}) + "\n"
    content, calls = split_calls(text, ["get_weather", "now"])
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("now", {}),
    ]
    splitter = CallSplitter(["get_weather", "now"])
    pieces = [p for ch in text for p in splitter.feed(ch)] + splitter.finish()
    assert "".join(p for k, p in pieces if k == "content") == "Let me look."
    assert [p.name for k, p in pieces if k == "call"] == ["get_weather", "now"]
    # text that is not a call of an offered tool stays content; an answer without calls is left as it is
    for plain in ('Hi <tool_call>\n{"name": "rm"}\n</tool_call>', "a < b\n", "<tool_call>{broken"):
        assert split_calls(plain, ["now"]) == (plain, [])
    # incremental: the arguments end at their own closing brace, braces and quotes in strings aside
    tricky = call("get_weather", {"city": 'a}"{\\b', "n": [1, {"x": []}]})
    splitter = CallSplitter(["get_weather"], incremental=True)
    pieces = [p for ch in tricky + "\n" for p in splitter.feed(ch)] + splitter.finish()
    assert pieces[0][0] == "open" and pieces[0][1][1] == "get_weather" and pieces[-1] == ("end", None)
    assert json.loads("".join(p for k, p in pieces if k == "arguments")) == {"city": 'a}"{\\b', "n": [1, {"x": []}]}
    # a forced call cut short by max_tokens is a call, its arguments as far as they got
    cut = call("get_weather", {"city": "Oslo"}).split("lo")[0]
    assert [(c.name, c.arguments) for c in split_calls(cut, ["get_weather"], incremental=True)[1]] == [
        ("get_weather", '{"city": "Os')
    ]
    # a last call the model left open is still a call
    assert split_calls(call("now", {})[: -len("</tool_call>")], ["now"])[1][0].name == "now"


def test_a_template_without_tools_is_shown_them_in_plain_messages():
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "content": "12 C", "tool_call_id": "c1"},
    ]
    plain = plain_messages(history, [WEATHER])
    assert [m["role"] for m in plain] == ["system", "user", "assistant", "user"]
    assert plain[0]["content"].startswith("Be brief.\n\n") and '"get_weather"' in plain[0]["content"]
    assert plain[2]["content"] == call("get_weather", {"city": "Oslo"})
    assert plain[3]["content"] == "<tool_response>\n12 C\n</tool_response>"
    assert plain_messages(history[1:2], [NOW])[0]["role"] == "system"
    two = plain_messages(history + [{"role": "tool", "content": "13 C", "tool_call_id": "c2"}], [WEATHER])
    assert (
        len(two) == 4
        and two[3]["content"] == "<tool_response>\n12 C\n</tool_response>\n<tool_response>\n13 C\n</tool_response>"
    )

    class Template:  # a tokenizer whose template ignores tools: the plain messages reach it
        seen = None

        def encode_chat(self, messages):
            Template.seen = messages
            return [1]

    encode(Template(), Prompt(messages=history, tools=[WEATHER]))
    assert Template.seen == plain


def test_tool_answers_in_openais_shape():
    ready = EngineReady("", "m", 100, 100, "cpu", "float32")
    tools = parse_tools([WEATHER, NOW], "required", None)
    text = call("get_weather", {"city": "Oslo"}) + call("now", {})
    body = ToolChatFormat(ready, False, tools).response(Generation(text=text, finish_reason=FinishReason.EOS), 5)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Oslo"}),
        ("function", "now", {}),
    ]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    fmt = ToolChatFormat(ready, False, tools)
    chunks = [c for piece in (text[:9], text[9:40], text[40:]) for c in fmt.chunks(piece, (), None)]
    chunks += fmt.chunks("", (), "stop")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[0]["tool_calls"][0]["index"] == 0 and deltas[0]["tool_calls"][0]["type"] == "function"
    assert json.loads(deltas[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert deltas[2]["tool_calls"][0]["index"] == deltas[3]["tool_calls"][0]["index"] == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and len(chunks) == 5
    # a forced call streams its arguments as they are written; auto sends each call whole
    for choice, whole in (("required", False), ("auto", True)):
        fmt = ToolChatFormat(ready, False, parse_tools([WEATHER, NOW], choice, None))
        chunks = [c for ch in text for c in fmt.chunks(ch, (), None)] + fmt.chunks("", (), "stop")
        calls: dict[int, list] = {}
        for delta in (c["choices"][0]["delta"] for c in chunks[:-1]):
            (entry,) = delta["tool_calls"]
            if "id" in entry:
                calls[entry["index"]] = [entry["function"]["name"], 0, ""]
            else:
                calls[entry["index"]][1] += 1
                calls[entry["index"]][2] += entry["function"]["arguments"]
        assert [(n, json.loads(a)) for n, _, a in calls.values()] == [("get_weather", {"city": "Oslo"}), ("now", {})]
        assert (calls[0][1] == 1) == whole and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # no calls: the plain answer, its finish reason unchanged
    plain = ToolChatFormat(ready, False, tools).response(Generation(text="Hi", finish_reason=FinishReason.EOS), 5)
    assert plain["choices"][0]["message"]["content"] == "Hi" and plain["choices"][0]["finish_reason"] == "stop"
    assert "tool_calls" not in plain["choices"][0]["message"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"name": "f"}]}, "tools[0].tool_name"),
        ({"tools": [{"tool_name": "f", "parameters": {"x": {"type": "string"}}}]}, "tools[0].parameters.x"),
        ({"tools": [{"tool_name": "f", "strict": True}]}, "strict"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"call_id": "1"}]}]}, "messages[0].tool_calls"),
    ],
)
def test_llama_stack_tools_are_checked(fields, param):
    from inference_api.web.dialects.llama_stack.protocol import parse_chat as llama_stack_chat

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(RequestError) as info:
        llama_stack_chat(body, lambda name: None)
    assert info.value.field == param, info.value


def test_llama_stack_tools_become_function_tools():
    from inference_api.web.dialects.llama_stack.protocol import parse_chat as llama_stack_chat

    body = {
        "model": "m",
        "tool_choice": "required",
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"call_id": "c1", "tool_name": "f", "arguments": {"q": "x"}}],
            },
            {"role": "ipython", "call_id": "c1", "tool_name": "f", "content": "found"},
        ],
        "tools": [
            {
                "tool_name": "f",
                "parameters": {"q": {"param_type": "str"}, "n": {"param_type": "int", "required": False}},
            }
        ],
    }
    req = llama_stack_chat(body, lambda name: None)
    assert req.tools.tools[0]["function"]["parameters"] == {
        "type": "object",
        "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["q"],
        "additionalProperties": False,
    }
    assert req.params.grammar is not None and req.messages[1]["tool_calls"][0]["function"] == {
        "name": "f",
        "arguments": {"q": "x"},
    }
    assert req.messages[2] == {"role": "tool", "content": "found", "tool_call_id": "c1"}
    assert llama_stack_chat({**body, "tools": [], "tool_choice": "auto"}, lambda name: None).tools is None
