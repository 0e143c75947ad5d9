"""OpenAI's Responses API (``POST /v1/responses``): a body parsed into the chat messages the template takes, the
tools and the engine's parameters, transport-free (raising ``request_errors``).

``input`` is a string (one user message) or a list of items: messages (``role`` user, assistant, system or
developer; ``content`` a string or ``input_text`` / ``output_text`` parts), ``function_call`` items (an
assistant's calls) and ``function_call_output`` items (their results); ``instructions`` is the system message.
Function tools, ``tool_choice`` and ``parallel_tool_calls`` go through the same grammar-forced calls as chat;
``text.format`` (``json_schema`` with its schema, ``json_object``) through the same structured output.
Built-in tools, background mode, images and files are refused by name. A reasoning model's thought comes back as a
reasoning item; ``reasoning.effort`` none closes it at once, the other efforts leave the server's budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....config import DEFAULT_MAX_STOP_SEQUENCES
from ....engine.grammar import ANY_JSON_OBJECT, Grammar, json_schema
from ....engine.messages import SamplingParams
from ....request.reasoning import Thinking, effort_budget
from ....request.tools import Tools, parse_tools
from ....request.validation import SEED_RANGE, boolean, number, reject_unknown, string
from ....request_errors import RequestError

# accepted with no effect here: OpenAI's service options
_SERVICE = {
    "metadata",
    "user",
    "safety_identifier",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "truncation",
    "include",
    "stream_options",
}
FIELDS = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "stream",
    "store",
    "previous_response_id",
    "background",
    "max_tool_calls",
    "top_logprobs",
    "conversation",
    "prompt",
    "reasoning",
    "seed",  # this server's (as chat's): the same answer for the same seed
} | _SERVICE
_BUILT_IN = {"web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview", "mcp"}
ROLES = {"user", "assistant", "system", "developer"}


@dataclass(frozen=True)
class ResponsesRequest:
    model: str
    instructions: str | None  # the system message (not carried into a later turn, as OpenAI's)
    input_messages: tuple[dict, ...]  # this request's turn (the chat form), after any earlier response's
    tools: Tools | None
    params: SamplingParams
    stream: bool
    store: bool
    previous_response_id: str | None
    echo: dict  # the request's fields a response object repeats (instructions, tools, text, ...)
    thinking: Thinking = Thinking(split=True)  # a reasoning model's thought: a reasoning item, and its budget


def _text(content, where: str) -> str:
    """A string, or ``input_text`` / ``output_text`` parts joined; other parts (images, files, audio): 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of input_text parts", where)
    parts = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestError(f"{at}: only text parts are supported (got type {kind!r})", at)
        parts.append(part["text"])
    return "".join(parts)


def input_messages(body: dict) -> list[dict]:
    """``input`` in the chat form (OpenAI's chat messages, validated by ``parse_messages``)."""
    out: list[dict] = []
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input is required: a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                raise RequestError(f"{where}.role must be one of {', '.join(sorted(ROLES))}", f"{where}.role")
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            function = {"name": string(item, "name", required=True), "arguments": item.get("arguments", "{}")}
            call = {"id": string(item, "call_id", required=True), "type": "function", "function": function}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:  # parallel calls: one turn
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "content": text, "tool_call_id": string(item, "call_id", required=True)})
        elif kind == "reasoning":
            continue  # a reasoning item sent back: its summary is not shown to the model again
        else:
            raise RequestError(
                f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)", where
            )
    return out


def _tools(body: dict) -> Tools | None:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools")
    functions = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in _BUILT_IN or (isinstance(kind, str) and kind.startswith(("web_search", "computer", "image_gen"))):
            raise RequestError(f"{where}.type {kind!r}: built-in tools are not supported by this server", where)
        if kind != "function":
            raise RequestError(f'{where} must be {{"type": "function", "name", "parameters"}}', where)
        reject_unknown(tool, {"type", "name", "description", "parameters", "strict"})
        function = {
            "name": tool.get("name"),
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
        }
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise RequestError(
                'tool_choice must be auto, none, required or {"type": "function", "name"}', "tool_choice"
            )
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if not functions:
        if choice not in (None, "auto", "none"):
            raise RequestError("tool_choice requires tools", "tool_choice")
        return None
    return parse_tools(functions, choice, body.get("parallel_tool_calls"))


def _text_format(body: dict) -> Grammar | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise RequestError("text must be an object {format, verbosity}", "text")
    reject_unknown(text, {"format", "verbosity"})
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "json_schema":
        reject_unknown(fmt, {"type", "name", "schema", "strict", "description"})
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format.schema must be a JSON schema object", "text.format.schema")
        return json_schema(fmt["schema"], "text.format.schema")
    raise RequestError("text.format.type must be text, json_object or json_schema", "text.format.type")


def _thinking(body: dict) -> Thinking:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return Thinking(split=True)
    if not isinstance(reasoning, dict):
        raise RequestError("reasoning must be an object {effort, summary}", "reasoning")
    reject_unknown(reasoning, {"effort", "summary", "generate_summary"})
    return Thinking(split=True, budget=effort_budget(reasoning.get("effort"), "reasoning.effort"))


def parse_responses(body: dict, max_stop: int = DEFAULT_MAX_STOP_SEQUENCES) -> ResponsesRequest:
    reject_unknown(body, FIELDS)
    for name, why in (
        ("background", "background mode is not supported by this server"),
        ("conversation", "conversations are not supported by this server: use previous_response_id"),
        ("prompt", "stored prompt templates are not supported by this server"),
    ):
        if body.get(name) not in (None, False):
            raise RequestError(why, name)
    if body.get("top_logprobs") not in (None, 0):
        raise RequestError("top_logprobs is not supported on /v1/responses; use /v1/chat/completions", "top_logprobs")
    model = string(body, "model", required=True)
    thinking = _thinking(body)  # (checked before the response's echo of it is built)
    tools = _tools(body)
    params = SamplingParams(
        temperature=number(body, "temperature", 1.0, 0, 2),
        top_p=number(body, "top_p", 1.0, 0, 1, lo_open=True),
        max_tokens=number(body, "max_output_tokens", None, 1, 1 << 31, integer=True),
        grammar=_text_format(body),
        seed=number(body, "seed", None, *SEED_RANGE, integer=True),
    )
    if tools is not None:
        params = tools.constrain(params)
    messages = input_messages(body)
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "text": body.get("text") or {"format": {"type": "text"}},
        "metadata": body.get("metadata") or {},
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
        "reasoning": {"effort": None, "summary": None, **(body.get("reasoning") or {})},
    }
    previous = string(body, "previous_response_id")
    return ResponsesRequest(
        model=model,
        instructions=string(body, "instructions"),
        input_messages=tuple(messages),
        tools=tools,
        params=params,
        stream=boolean(body, "stream", False),
        store=boolean(body, "store", True),
        previous_response_id=previous,
        echo=echo,
        thinking=thinking,
    )
