"""llama-stack request parsing: the bodies of /inference/completion and /inference/chat_completion (their
shapes: ``routes``). The model check is the caller's (``check_model``), made once the body's field names are
known good and before their values are checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ....engine.grammar import Grammar, json_schema, maybe_json, text_grammar
from ....engine.messages import SamplingParams
from ....request.tools import Tools, assistant_calls, parse_tools
from ....request.validation import boolean, number, reject_unknown, string
from ....request_errors import RequestError

STRATEGIES = ("greedy", "top_p", "top_k")
SAMPLING_FIELDS = {"strategy", "temperature", "top_p", "top_k", "max_tokens", "repetition_penalty"}
COMPLETION_FIELDS = {"model", "content", "sampling_params", "stream", "logprobs", "response_format"}
CHAT_FIELDS = {
    "model",
    "messages",
    "sampling_params",
    "stream",
    "logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "tool_prompt_format",
}
MESSAGE_FIELDS = {"role", "content", "context", "stop_reason", "tool_calls", "call_id", "tool_name"}
# ToolParamDefinition.param_type (Python's names, as Llama's tool prompts write them, or JSON schema's) -> JSON type
PARAM_TYPES = {
    "str": "string",
    "string": "string",
    "int": "integer",
    "integer": "integer",
    "float": "number",
    "number": "number",
    "bool": "boolean",
    "boolean": "boolean",
    "list": "array",
    "array": "array",
    "dict": "object",
    "object": "object",
}


@dataclass(frozen=True)
class LlamaStackRequest:
    params: SamplingParams
    stream: bool
    content: str | None = None
    messages: tuple[dict, ...] | None = None
    tools: Tools | None = None  # chat: offered to the model (tools.py), its calls answered as ToolCalls


def _text(content, where: str) -> str:
    """InterleavedTextMedia: a string or a list of strings (images are not supported)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(c, str) for c in content):
        return "".join(content)
    raise RequestError(f"{where} must be a string or a list of strings (images are not supported)", where)


def _sampling(body: dict) -> SamplingParams:
    sp = body.get("sampling_params")
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise RequestError("sampling_params must be an object", "sampling_params")
    reject_unknown(sp, SAMPLING_FIELDS)
    strategy = sp.get("strategy", "greedy")
    if strategy not in STRATEGIES:
        raise RequestError(
            f"sampling_params.strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}",
            "sampling_params.strategy",
        )
    temperature = number(sp, "temperature", 0.0, 0, 100)
    top_p = number(sp, "top_p", 0.95, 0, 1)
    top_k = number(sp, "top_k", 0, 0, 1_000_000, integer=True)
    max_tokens = number(sp, "max_tokens", 0, 0, 1 << 31, integer=True)
    repetition = number(sp, "repetition_penalty", 1.0, 0, 10, lo_open=True)
    greedy = strategy == "greedy" or temperature == 0 or (strategy == "top_p" and top_p == 0)
    params = SamplingParams(
        temperature=0.0 if greedy else temperature,
        top_p=top_p if strategy == "top_p" else 1.0,
        top_k=top_k if strategy == "top_k" else 0,
        repetition_penalty=repetition,
        max_tokens=max_tokens or None,  # 0 (the default): as many as fit, at most prepare's DEFAULT_MAX_TOKENS
    )
    return params


def _logprobs(body: dict) -> int | None:
    lp = body.get("logprobs")
    if lp is None:
        return None
    if not isinstance(lp, dict):
        raise RequestError('logprobs must be an object {"top_k": int}', "logprobs")
    reject_unknown(lp, {"top_k"})
    return number(lp, "top_k", 0, 0, 20, integer=True)


def _common(body: dict, check_model: Callable[[str], None], **prompt) -> LlamaStackRequest:
    check_model(string(body, "model", required=True))
    params = _sampling(body)
    params = dataclasses.replace(params, grammar=llama_stack_format(body.get("response_format")))
    logprobs = _logprobs(body)
    if logprobs is not None:
        params = dataclasses.replace(params, logprobs=logprobs)
    return LlamaStackRequest(params=params, stream=boolean(body, "stream", False), **prompt)


def parse_completion(body: dict, check_model: Callable[[str], None]) -> LlamaStackRequest:
    reject_unknown(body, COMPLETION_FIELDS)
    if body.get("content") is None:
        raise RequestError("content is required", "content")
    return _common(body, check_model, content=_text(body["content"], "content"))


def parse_chat(body: dict, check_model: Callable[[str], None]) -> LlamaStackRequest:
    reject_unknown(body, CHAT_FIELDS)
    if body.get("tool_choice") not in (None, "auto", "required"):
        raise RequestError("tool_choice must be auto or required", "tool_choice")
    if body.get("tool_prompt_format") not in (None, "json", "function_tag", "python_list"):
        raise RequestError("tool_prompt_format must be json, function_tag or python_list", "tool_prompt_format")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages is required: a non-empty list of {role, content}", "messages")
    out: list[dict] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "system", "assistant", "ipython"):
            role = msg.get("role") if isinstance(msg, dict) else None
            raise RequestError(f"{where}.role must be user, system, assistant or ipython, got {role!r}", where)
        reject_unknown(msg, MESSAGE_FIELDS)
        text = _text(msg.get("content"), f"{where}.content")
        if msg.get("context") is not None:  # UserMessage.context: retrieved text shown with the question
            text = f"{text}\n\n{_text(msg['context'], f'{where}.context')}"
        if msg["role"] == "ipython":  # ToolResponseMessage: a tool's result
            out.append({"role": "tool", "content": text, "tool_call_id": str(msg.get("call_id") or "")})
        elif msg.get("tool_calls") and msg["role"] == "assistant":  # CompletionMessage with its ToolCalls
            out.append(
                {
                    "role": "assistant",
                    "content": text,
                    "tool_calls": assistant_calls([_openai_call(c) for c in msg["tool_calls"]], f"{where}.tool_calls"),
                }
            )
        elif msg.get("tool_calls"):
            raise RequestError(f"{where}.tool_calls are only an assistant's", f"{where}.tool_calls")
        else:
            out.append({"role": msg["role"], "content": text})
    req = _common(body, check_model, messages=tuple(out))
    tools = _tools(body.get("tools"), body.get("tool_choice"))
    if tools is None:
        return req
    return dataclasses.replace(req, tools=tools, params=tools.constrain(req.params))


def _openai_call(call) -> dict:
    """A ToolCall ``{call_id, tool_name, arguments}`` in OpenAI's shape (``tools.assistant_calls`` reads it)."""
    if not isinstance(call, dict):
        return {}
    return {
        "id": call.get("call_id"),
        "type": "function",
        "function": {"name": call.get("tool_name"), "arguments": call.get("arguments", {})},
    }


def _tools(tools, tool_choice) -> Tools | None:
    """llama-stack's ToolDefinitions ``{tool_name, description?, parameters?: {name: {param_type, description?,
    required? (true), default?}}}`` as OpenAI function tools; tool_choice auto (the default) or required. Without
    tools, tool_choice changes nothing (llama-stack's clients send auto)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {tool_name, description, parameters}", "tools")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("tool_name"), str):
            raise RequestError(f"{where} must be {{tool_name, description?, parameters?}}", f"{where}.tool_name")
        reject_unknown(tool, {"tool_name", "description", "parameters"})
        params = tool.get("parameters") or {}
        if not isinstance(params, dict):
            raise RequestError(f"{where}.parameters must be an object of {{param_type, ...}}", f"{where}.parameters")
        properties, required = {}, []
        for name, spec in params.items():
            at = f"{where}.parameters.{name}"
            if not isinstance(spec, dict) or not isinstance(spec.get("param_type"), str):
                raise RequestError(f"{at} must be {{param_type, description?, required?}}", at)
            kind = PARAM_TYPES.get(spec["param_type"].lower())
            properties[name] = {
                **({"type": kind} if kind else {}),
                **({"description": spec["description"]} if isinstance(spec.get("description"), str) else {}),
            }
            if spec.get("required", True):
                required.append(name)
        functions.append(
            {
                "type": "function",
                "function": {
                    "name": tool["tool_name"],
                    **({"description": tool["description"]} if tool.get("description") else {}),
                    "parameters": {
                        "type": "object",
                        "properties": properties,
                        "required": required,
                        "additionalProperties": False,
                    },
                },
            }
        )
    return parse_tools(functions, tool_choice or "auto", None)


def llama_stack_format(value, field: str = "response_format") -> Grammar | None:
    """llama-stack's response_format: ``{"type": "json_schema", "json_schema": schema}`` or
    ``{"type": "grammar", "bnf": {...}}`` (a GBNF grammar, as its own root rule ``root``)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("json_schema", "grammar"):
        raise RequestError(f"{field}.type must be json_schema or grammar", f"{field}.type")
    if value["type"] == "json_schema":
        return json_schema(maybe_json(value.get("json_schema"), f"{field}.json_schema"), f"{field}.json_schema")
    bnf = value.get("bnf")
    if isinstance(bnf, dict):  # llama-stack sends the grammar as {"root": "..."} or {"grammar": "..."}
        bnf = bnf.get("grammar") or "\n".join(f"{k} ::= {v}" for k, v in bnf.items())
    return text_grammar("grammar", bnf, f"{field}.bnf")
