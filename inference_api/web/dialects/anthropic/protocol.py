"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): a body parsed into the chat
messages the template takes, the tools, and the engine's parameters, transport-free (raising ``request_errors``).

Content blocks map onto the chat form every dialect shares: ``text`` blocks join into a message's content,
an assistant's ``tool_use`` blocks become its ``tool_calls``, a user's ``tool_result`` blocks become ``tool``
messages (before the rest of that user turn); ``system`` (a string or text blocks) is the system message. Tools
``{name, description, input_schema}`` are function tools; ``tool_choice`` auto, any (a call required), tool
(that one forced) or none, with ``disable_parallel_tool_use``, through the same grammar-forced calls as chat.
``output_config.format`` (a JSON schema: the SDK's ``messages.parse``) is the same structured output as every
dialect's. The sampling fields (``temperature``, ``top_p``, ``top_k``) are taken where a client sends them (the
current SDK sends them only in ``extra_body``). Fields about Anthropic's service (``cache_control``: the prefix
cache needs no hint; ``service_tier``, ``speed``, ``inference_geo``, ``metadata``, ``output_config.effort``...)
are accepted with no effect; built-in tools and images are refused by name. ``thinking`` sets a reasoning
model's thought: ``enabled`` with ``budget_tokens`` (its budget; Anthropic's floor of 1,024 is not imposed),
``adaptive`` (the server's budget) or ``disabled`` (closed at once); the thought comes back as a ``thinking`` block
(with an empty signature), and thinking blocks sent back in the history are not shown to the model again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ....config import DEFAULT_MAX_STOP_SEQUENCES
from ....engine.grammar import Grammar, json_schema
from ....engine.messages import SamplingParams
from ....request.reasoning import Thinking, budget_field
from ....request.tools import Tools, assistant_calls, parse_tools
from ....request.validation import SEED_RANGE, boolean, number, reject_unknown, stop_list, string
from ....request_errors import RequestError
from ..openai.protocol import parse_messages

# accepted with no effect here: Anthropic's service options
_SERVICE = {"cache_control", "metadata", "service_tier", "speed", "inference_geo", "diagnostics", "user_profile_id"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"} | _SERVICE
# (seed: this server's, as chat's: the same answer for the same seed)
MESSAGES_FIELDS = COUNT_FIELDS | {"max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream", "seed"}
_UNSUPPORTED = {  # fields of Anthropic's API this server refuses by name rather than ignore
    "mcp_servers": "MCP servers are not supported by this server",
    "container": "code-execution containers are not supported by this server",
    "workspace_id": "workspaces are not supported by this server",
}
BLOCKS = {"user": {"text", "tool_result"}, "assistant": {"text", "tool_use", "thinking", "redacted_thinking"}}


@dataclass(frozen=True)
class MessagesRequest:
    model: str
    messages: tuple[dict, ...]  # the chat form (parse_messages' output)
    tools: Tools | None
    params: SamplingParams  # max_tokens required by the API
    stream: bool
    stop_sequences: tuple[str, ...]
    thinking: Thinking = Thinking(split=True)  # a reasoning model's thought: a thinking block, and its budget


def _text(blocks, where: str) -> str:
    """A string, or text blocks joined (their ``cache_control`` accepted: the prefix cache needs no hint)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise RequestError(f"{where} must be a string or a list of text blocks", where)
    parts = []
    for i, block in enumerate(blocks):
        at = f"{where}[{i}]"
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise RequestError(f"{at} must be a text block {{type: text, text}} (got type {kind!r})", at)
        reject_unknown(block, {"type", "text", "cache_control", "citations"})
        parts.append(block["text"])
    return "".join(parts)


def _messages(body: dict) -> list[dict]:
    """The conversation in the chat form's messages (OpenAI's shape, validated by ``parse_messages`` after)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages is required: a non-empty list of {role, content}", "messages")
    out: list[dict] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text(body["system"], "system")})
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in BLOCKS:
            role = msg.get("role") if isinstance(msg, dict) else None
            raise RequestError(f"{where}.role must be user or assistant, got {role!r}", f"{where}.role")
        reject_unknown(msg, {"role", "content"})
        role, content = msg["role"], msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        texts, calls, results = [], [], []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCKS[role]:
                allowed = " or ".join(sorted(BLOCKS[role]))
                raise RequestError(f"{at}: a {role} message's blocks are {allowed}, got type {kind!r}", at)
            if kind in ("thinking", "redacted_thinking"):
                continue  # a past thought sent back: not shown to the model again
            if kind == "text":
                texts.append(_text([block], at))
            elif kind == "tool_use":
                reject_unknown(block, {"type", "id", "name", "input", "cache_control"})
                if not isinstance(block.get("input", {}), dict):
                    raise RequestError(f"{at}.input must be an object", f"{at}.input")
                call = {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}
                calls.append({"id": string(block, "id", default=""), "type": "function", "function": call})
            else:  # tool_result
                reject_unknown(block, {"type", "tool_use_id", "content", "is_error", "cache_control"})
                result = block.get("content", "")
                text = _text(result, f"{at}.content") if result is not None else ""
                if boolean(block, "is_error", False):
                    text = f"Error: {text}"
                results.append(
                    {"role": "tool", "content": text, "tool_call_id": string(block, "tool_use_id", default="")}
                )
        out += results
        if calls:
            out.append({"role": "assistant", "content": "".join(texts), "tool_calls": assistant_calls(calls, where)})
        elif texts or not results:
            out.append({"role": role, "content": "".join(texts)})
    return out


def parse_tools_field(body: dict) -> Tools | None:
    """``tools`` and ``tool_choice`` as the chat form's function tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list of {name, description, input_schema}", "tools")
    functions = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise RequestError(f"{where} must be {{name, description?, input_schema}}", f"{where}.name")
        if tool.get("type") not in (None, "custom"):
            raise RequestError(f"{where}.type {tool['type']!r}: built-in tools are not supported by this server", where)
        reject_unknown(tool, {"type", "name", "description", "input_schema", "cache_control"})
        function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object", "properties": {}})}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    parallel = None
    openai_choice: str | dict | None = None
    if choice is None:
        pass
    elif not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise RequestError('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}', "tool_choice")
    else:
        reject_unknown(choice, {"type", "name", "disable_parallel_tool_use"})
        if boolean(choice, "disable_parallel_tool_use", False):
            parallel = False
        kind = choice["type"]
        if kind == "tool":
            name = string(choice, "name", required=True)
            openai_choice = {"type": "function", "function": {"name": name}}
        else:
            openai_choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if not functions:
        if choice is not None and choice.get("type") not in ("auto", "none"):
            raise RequestError("tool_choice requires tools", "tool_choice")
        return None
    return parse_tools(functions, openai_choice, parallel)


def _output_format(config) -> Grammar | None:
    """``output_config``: ``format`` {type: json_schema, schema} as the request's grammar; ``effort`` accepted."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise RequestError("output_config must be an object", "output_config")
    reject_unknown(config, {"format", "effort"})
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise RequestError(
            'output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config.format"
        )
    return json_schema(fmt["schema"], "output_config.format.schema")


def _refuse_unsupported(body: dict) -> None:
    for name, why in _UNSUPPORTED.items():
        if body.get(name) is not None:
            raise RequestError(why, name)


THINKING_TYPES = ("enabled", "adaptive", "disabled")


def _thinking(body: dict) -> Thinking:
    """``thinking``: enabled (``budget_tokens``), adaptive (the server's budget) or disabled (a budget of 0)."""
    value = body.get("thinking")
    if value is None:
        return Thinking(split=True)
    if not isinstance(value, dict) or value.get("type") not in THINKING_TYPES:
        raise RequestError(f"thinking must be an object whose type is {', '.join(THINKING_TYPES)}", "thinking.type")
    reject_unknown(value, {"type", "budget_tokens", "display"})
    if value["type"] == "disabled":
        return Thinking(split=True, budget=0)
    if value["type"] == "adaptive":
        return Thinking(split=True)
    if value.get("budget_tokens") is None:
        raise RequestError("thinking.budget_tokens is required when thinking is enabled", "thinking.budget_tokens")
    budget = budget_field(value["budget_tokens"], "thinking.budget_tokens", minimum=1)
    if isinstance(body.get("max_tokens"), int) and budget is not None and budget >= body["max_tokens"]:
        raise RequestError("thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens")
    return Thinking(split=True, budget=budget)


def parse_messages_request(body: dict, max_stop: int = DEFAULT_MAX_STOP_SEQUENCES) -> MessagesRequest:
    reject_unknown(body, MESSAGES_FIELDS | set(_UNSUPPORTED))
    _refuse_unsupported(body)
    model = string(body, "model", required=True)
    if body.get("max_tokens") is None:
        raise RequestError("max_tokens is required", "max_tokens")
    stops = stop_list(body, "stop_sequences", max_stop)
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise RequestError("metadata must be an object", "metadata")
    params = SamplingParams(
        temperature=number(body, "temperature", 1.0, 0, 1),
        top_p=number(body, "top_p", 1.0, 0, 1, lo_open=True),
        top_k=number(body, "top_k", 0, 0, 1_000_000, integer=True),
        stop=stops,
        max_tokens=number(body, "max_tokens", None, 1, 1 << 31, integer=True),
        grammar=_output_format(body.get("output_config")),
        seed=number(body, "seed", None, *SEED_RANGE, integer=True),
    )
    tools = parse_tools_field(body)
    if tools is not None:
        params = tools.constrain(params)
    return MessagesRequest(
        model=model,
        messages=parse_messages(_messages(body)),
        tools=tools,
        params=params,
        stream=boolean(body, "stream", False),
        stop_sequences=stops,
        thinking=_thinking(body),
    )


def parse_count_tokens(body: dict) -> tuple[str, tuple[dict, ...], Tools | None]:
    """``/v1/messages/count_tokens``: (model, messages, tools)."""
    reject_unknown(body, COUNT_FIELDS | set(_UNSUPPORTED))
    _refuse_unsupported(body)
    _thinking(body)
    return string(body, "model", required=True), parse_messages(_messages(body)), parse_tools_field(body)
