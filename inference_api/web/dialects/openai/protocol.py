"""OpenAI request parsing: /v1/completions and /v1/chat/completions bodies into sampling parameters.

Fields the server implements are validated with their OpenAI ranges; fields it does not implement are
accepted only at a value that changes nothing (``only_default``); anything else is a 400 naming the field.
The offline ``SamplingParams`` are the completions API's sampling fields (``completion_sampling``), and its
prompts are parsed as that API's (``parse_prompt``, ``parse_messages``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ....config import DEFAULT_MAX_STOP_SEQUENCES, MAX_CHOICES
from ....engine.grammar import ANY_JSON_OBJECT, Grammar, choice, json_schema, maybe_json, one_of, text_grammar
from ....engine.messages import SamplingParams
from ....request.reasoning import Thinking, budget_field, effort_budget
from ....request.tools import Tools, assistant_calls, parse_tools
from ....request.validation import (
    SEED_RANGE,
    boolean,
    number,
    only_default,
    penalties,
    reject_unknown,
    stop_list,
    string,
    token_ids,
)
from ....request_errors import RequestError

# sent by clients, harmless to ignore: they do not change what the model generates
# vLLM's structured outputs: the older guided_* fields, the newer structured_outputs object
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object"}

_IGNORED = {
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "parallel_tool_calls",
}
# vLLM's sampling extras, which tools built for vLLM send (GuideLLM, h2oGPT's vLLM mode)
MAX_STOP_TOKEN_IDS = 1024  # each is checked against every token of the request
VLLM_EXTRAS = {
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "cache_salt",
    "speculative",  # this server's: false keeps the request's rows from drafting (speculative decoding)
}
MAX_CACHE_SALT = 256  # characters of cache_salt
# what parse_sampling reads
SAMPLING_FIELDS = (
    {
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "response_format",
    }
    | VLLM_EXTRAS
    | set(GUIDED_FIELDS)
    | {"structured_outputs"}
)
COMPLETION_SAMPLING_FIELDS = frozenset(SAMPLING_FIELDS | {"logprobs", "best_of"})  # what completion_sampling reads
_COMMON = SAMPLING_FIELDS | {"model", "stream", "stream_options", "logprobs", "lora"}
MAX_LORA = 8  # adapters one request may name in its lora list
COMPLETION_FIELDS = _COMMON | _IGNORED | {"prompt", "echo", "best_of", "suffix", "prompt_logprobs"}
# chat fields accepted only when absent (null): features this server does not have
_ONLY_ABSENT = (
    "audio",
    "prediction",
    "verbosity",
    "web_search_options",
    "moderation",
    "prompt_cache_options",
)
CHAT_FIELDS = (
    _COMMON
    | _IGNORED
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "tool_prompt",
        "reasoning_effort",
        "reasoning_format",
        "thinking_budget_tokens",
        "functions",
        "function_call",
        "modalities",
    }
    | set(_ONLY_ABSENT)
)
ROLES = {"system", "developer", "user", "assistant", "tool"}
# (an assistant turn's reasoning_content, which clients send back as they got it, is accepted and not shown to the
# model again, as reasoning models' templates drop past thoughts)
_MESSAGE_FIELDS = {
    "role",
    "content",
    "name",
    "refusal",
    "tool_calls",
    "tool_call_id",
    "function_call",
    "audio",
    "reasoning_content",
    "reasoning",
}


@dataclass(frozen=True)
class OpenAIRequest:
    model: str
    params: SamplingParams  # max_tokens is filled in once the prompt length is known
    max_tokens_field: str  # the field max_tokens came from, for error messages
    stream: bool
    include_usage: bool
    continuous_usage: bool  # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    prompt: str | None = None  # completions: text ...
    prompt_ids: tuple[int, ...] | None = None  # ... or token ids
    messages: tuple[dict, ...] | None = None  # chat: {"role", "content"} with content a string
    echo: bool = False  # completions: the prompt before each choice's text (and its log-probs with logprobs)
    prompt_logprobs: int | None = None  # completions, vLLM's prompt_logprobs: the prompt tokens' log-probs + top N
    tools: Tools | None = None  # chat: the request's tools and tool_choice (tools.py)
    thinking: Thinking = Thinking(split=True)  # chat: a reasoning model's thought, apart or not, and its budget
    # llama-server's per-request LoRA adapters: (id in the model's adapter list, or this server's name, scale)
    lora: tuple[tuple[int | str, float], ...] = ()


def parse_completion(body: dict, vocab_size: int, max_stop: int = DEFAULT_MAX_STOP_SEQUENCES) -> OpenAIRequest:
    reject_unknown(body, COMPLETION_FIELDS)
    echo = boolean(body, "echo", False)
    only_default(body, "suffix", "")
    prompt, prompt_ids = parse_prompt(body.get("prompt"), vocab_size)
    params = completion_sampling(body, vocab_size, max_stop)
    vllm_prompt = number(body, "prompt_logprobs", None, 0, 20, integer=True)
    wanted = [n for n in (params.logprobs if echo else None, vllm_prompt) if n is not None]
    if wanted:  # the prompt's tokens get log-probs, computed in its prefill
        params = dataclasses.replace(params, prompt_logprobs=max(wanted))
    return _request(
        body,
        params,
        "max_tokens",
        prompt=prompt,
        prompt_ids=prompt_ids,
        echo=echo,
        prompt_logprobs=vllm_prompt,
    )


def completion_sampling(body: dict, vocab_size: int, max_stop: int = DEFAULT_MAX_STOP_SEQUENCES) -> SamplingParams:
    """The sampling fields of a /v1/completions body (``COMPLETION_SAMPLING_FIELDS``), max_tokens among them."""
    only_default(body, "best_of", 1)
    logprobs = number(body, "logprobs", None, 0, 5, integer=True)
    return parse_sampling(body, logprobs, "max_tokens", vocab_size, max_stop)


def parse_chat(body: dict, vocab_size: int, max_stop: int = DEFAULT_MAX_STOP_SEQUENCES) -> OpenAIRequest:
    reject_unknown(body, CHAT_FIELDS)
    for name, neutral in (("functions", []), ("function_call", "none")):
        if body.get(name) is not None and body[name] != neutral:  # a clear pointer, not a silently ignored field
            raise RequestError(
                f"{name} is OpenAI's deprecated form of tools; send tools and tool_choice (answers carry tool_calls)",
                name,
            )
    only_default(body, "modalities", ["text"])
    for name in _ONLY_ABSENT:
        only_default(body, name)
    messages = parse_messages(body.get("messages"))
    top = number(body, "top_logprobs", None, 0, 20, integer=True)
    want = boolean(body, "logprobs", False)
    if top is not None and not want:
        raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = parse_sampling(body, (top or 0) if want else None, field, vocab_size, max_stop)
    string(body, "tool_prompt")  # TGI's preamble to its tools: accepted, the server describes tools its own way
    tools = parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    if tools is not None:
        params = tools.constrain(params)
    return _request(body, params, field, messages=messages, tools=tools, thinking=_thinking(body))


REASONING_FORMATS = ("auto", "deepseek", "none")  # llama-server's per-request reasoning_format


def _thinking(body: dict) -> Thinking:
    """A chat request's thought: apart (``reasoning_content``) unless llama-server's ``reasoning_format`` is none;
    its budget from llama-server's ``thinking_budget_tokens``, or 0 for OpenAI's ``reasoning_effort: none``."""
    fmt = body.get("reasoning_format")
    if fmt is not None and fmt not in REASONING_FORMATS:
        raise RequestError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}", "reasoning_format")
    budget = budget_field(body.get("thinking_budget_tokens"), "thinking_budget_tokens")
    if budget is None:
        budget = effort_budget(body.get("reasoning_effort"), "reasoning_effort")
    return Thinking(split=fmt != "none", budget=budget)


def _request(body: dict, params: SamplingParams, max_field: str, **prompt) -> OpenAIRequest:
    model = string(body, "model", required=True)
    stream = boolean(body, "stream", False)
    include_usage, continuous_usage = _stream_options(body.get("stream_options"), stream)
    return OpenAIRequest(
        model=model,
        params=params,
        max_tokens_field=max_field,
        stream=stream,
        include_usage=include_usage or continuous_usage,
        continuous_usage=continuous_usage,
        lora=parse_lora(body.get("lora")),
        **prompt,
    )


def parse_lora(value) -> tuple[tuple[int | str, float], ...]:
    """llama-server's ``lora``: a list of ``{"id": N, "scale": S}`` (N: the adapter's place in the server's list,
    as its /lora-adapters shows it), or ``{"name": ..., "scale": S}`` (this server's); scale 1 when absent."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_LORA:
        raise RequestError(f"lora must be a list of at most {MAX_LORA} objects {{id or name, scale}}", "lora")
    out: list[tuple[int | str, float]] = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise RequestError(f"lora[{i}] must be an object with id (or name) and scale", "lora")
        reject_unknown(entry, {"id", "name", "scale"})
        ref = number(entry, "id", None, 0, 1 << 16, integer=True)
        name = string(entry, "name")
        if (ref is None) == (name is None):
            raise RequestError(f"lora[{i}] needs one of id and name", "lora")
        scale = float(number(entry, "scale", 1.0, -16, 16))
        out.append((ref, scale) if ref is not None else (str(name), scale))
    return tuple(out)


def parse_sampling(body: dict, logprobs: int | None, max_field: str, vocab_size: int, max_stop: int) -> SamplingParams:
    """The sampling fields both endpoints share (``SAMPLING_FIELDS``, ``logprobs`` parsed by the endpoint), with
    max_tokens from ``max_field`` (None when absent: as many as fit)."""
    logit_bias = body.get("logit_bias")
    if logit_bias is not None and logit_bias != {}:
        raise RequestError("logit_bias is not supported by this server", "logit_bias")
    boolean(body, "skip_special_tokens", True)  # accepted: special tokens are never shown
    boolean(body, "spaces_between_special_tokens", True)
    only_default(body, "include_stop_str_in_output", False)
    temperature = number(body, "temperature", 1.0, 0, 2)
    top_p = number(body, "top_p", 1.0, 0, 1)
    params = SamplingParams(
        temperature=0.0 if top_p == 0 else temperature,  # top_p 0 keeps only the top token: greedy
        top_k=number(body, "top_k", 0, 0, 1_000_000, integer=True),
        top_p=top_p or 1.0,
        min_p=number(body, "min_p", 0.0, 0, 1),
        stop=stop_list(body, "stop", max_stop),
        stop_token_ids=token_ids(body, "stop_token_ids", vocab_size, limit=MAX_STOP_TOKEN_IDS),
        min_tokens=number(body, "min_tokens", 0, 0, 1 << 31, integer=True),
        ignore_eos=boolean(body, "ignore_eos", False),
        seed=number(body, "seed", None, *SEED_RANGE, integer=True),
        logprobs=logprobs,
        grammar=one_of(response_format(body.get("response_format")), vllm_guided(body), field="response_format"),
        n=number(body, "n", 1, 1, MAX_CHOICES, integer=True),
        cache_salt=_cache_salt(body),
        speculate=boolean(body, "speculative", True),
        **penalties(body),
    )
    max_tokens = number(body, max_field, None, 1, 1 << 31, integer=True)
    if max_tokens is not None and params.min_tokens > max_tokens:
        raise RequestError(f"min_tokens ({params.min_tokens}) must not exceed {max_field} ({max_tokens})", "min_tokens")
    return dataclasses.replace(params, max_tokens=max_tokens)


def _cache_salt(body: dict) -> str | None:
    """vLLM's cache_salt: the prompt reuses only the prefix cache of requests with the same salt (within its
    team, which the cache always separates)."""
    salt = string(body, "cache_salt")
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT:
        raise RequestError(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters", "cache_salt"
        )
    return salt


def _stream_options(options, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats)."""
    if options is None:
        return False, False
    if not stream:
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    reject_unknown(options, {"include_usage", "include_obfuscation", "continuous_usage_stats"})
    boolean(options, "include_obfuscation", False)  # accepted; this server never pads chunks
    return boolean(options, "include_usage", False), boolean(options, "continuous_usage_stats", False)


def parse_prompt(prompt, vocab_size: int) -> tuple[str | None, tuple[int, ...] | None]:
    """(text, token ids), one of them None: a string, a list of one string, a list of token ids, or a list of one
    list of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt must not be empty", "prompt")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise RequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise RequestError(
            "batched prompts are not supported: send one prompt (a string or a list of token ids) per request", "prompt"
        )
    raise RequestError("prompt is required: a non-empty string, a list of one string, or a list of token ids", "prompt")


def parse_messages(messages) -> tuple[dict, ...]:
    """Chat messages as the template takes them: {role, content} with content a string; a tool result also has
    its ``tool_call_id``, an assistant's calls are ``tool_calls`` (``tools.assistant_calls``, content then "" when
    null)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages is required: a non-empty list of {role, content} objects", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(f"{where} must be an object with role and content", where)
        role = msg.get("role")
        if role not in ROLES:
            raise RequestError(
                f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}"
                + (" (send tool results with role tool)" if role == "function" else ""),
                f"{where}.role",
            )
        unknown = sorted(set(msg) - _MESSAGE_FIELDS)
        if unknown:
            raise RequestError(f"{where}: unknown field {unknown[0]!r}", f"{where}.{unknown[0]}")
        for name in ("function_call", "audio") + (() if role == "assistant" else ("tool_calls",)):
            if msg.get(name):
                raise RequestError(f"{where}.{name} is not supported by this server", f"{where}.{name}")
        string(msg, "name")  # accepted, not shown to the model
        if msg.get("tool_calls"):
            out.append(
                {
                    "role": "assistant",
                    "content": "" if msg.get("content") is None else _content(msg["content"], f"{where}.content"),
                    "tool_calls": assistant_calls(msg["tool_calls"], f"{where}.tool_calls"),
                }
            )
            continue
        entry = {
            "role": "system" if role == "developer" else role,
            "content": _content(msg.get("content"), f"{where}.content"),
        }
        if role == "tool":
            entry["tool_call_id"] = string(msg, "tool_call_id", default="")
        out.append(entry)
    return tuple(out)


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else None
                raise RequestError(
                    f'{where}[{j}] must be {{"type": "text", "text": string}}'
                    + (f"; {kind!r} parts are not supported" if kind and kind != "text" else ""),
                    f"{where}[{j}]",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError(f"{where} must be a string or a non-empty list of text parts", where)


@dataclass(frozen=True)
class TokenizeRequest:
    prompt: str | None
    messages: tuple[dict, ...] | None
    add_special_tokens: bool
    return_token_strs: bool
    tools: tuple[dict, ...] | None = None  # function tools the chat template shows


TOKENIZE_FIELDS = {
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "return_token_strs",
    "chat_template",
    "chat_template_kwargs",
    "tools",
}


def parse_tokenize(body: dict) -> TokenizeRequest:
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``)."""
    reject_unknown(body, TOKENIZE_FIELDS)
    only_default(body, "add_generation_prompt", True)  # the chat prompt always ends with the assistant's turn
    only_default(body, "continue_final_message", False)
    for name in ("chat_template", "chat_template_kwargs"):
        only_default(body, name)
    messages = parse_messages(body["messages"]) if body.get("messages") is not None else None
    prompt = None if messages is not None else string(body, "prompt", required=True)
    if messages is None and body.get("tools") is not None:
        raise RequestError("tools go with messages (the chat template shows them)", "tools")
    tools = parse_tools(body.get("tools"), None, None)  # shown as a chat request's would be
    return TokenizeRequest(
        prompt=prompt,
        messages=messages,
        add_special_tokens=boolean(body, "add_special_tokens", messages is None),
        return_token_strs=boolean(body, "return_token_strs", False),
        tools=tools.tools if tools is not None else None,
    )


def parse_detokenize(body: dict, vocab_size: int) -> tuple[int, ...]:
    reject_unknown(body, {"model", "tokens"})
    return token_ids(body, "tokens", vocab_size, required=True)


# the structured-output fields, each parsed here into the one Grammar
def response_format(value, field: str = "response_format") -> Grammar | None:
    """OpenAI's response_format (text, json_object, json_schema with its schema), and TGI's forms of it
    (``{"type": "json" | "json_object", "value": schema}``, ``{"type": "regex", "value": ...}``)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise RequestError(f"{field} must be an object with a type", field)
    kind = value["type"]
    if kind == "text":
        return None
    if kind in ("json", "json_object") and value.get("value") is not None:  # TGI's: the schema as value
        return json_schema(maybe_json(value["value"], f"{field}.value"), f"{field}.value")
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError(f"{field}.json_schema must be an object with a schema", f"{field}.json_schema")
        schema = spec.get("schema", {"type": "object"} if "schema" not in spec else None)
        return json_schema(maybe_json(schema, f"{field}.json_schema.schema"), f"{field}.json_schema.schema")
    if kind == "regex" and value.get("value") is not None:
        return text_grammar("regex", value["value"], f"{field}.value")
    raise RequestError(f"{field}.type {kind!r} is not supported; use text, json_object or json_schema", field)


def vllm_guided(body: dict) -> Grammar | None:
    """vLLM's guided_json / guided_regex / guided_choice / guided_grammar, or structured_outputs: at most one."""
    found = [(GUIDED_FIELDS[f], body[f], f) for f in GUIDED_FIELDS if body.get(f) is not None]
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise RequestError("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(
            set(outputs)
            - STRUCTURED_KEYS
            - {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "backend"}
        )
        if unknown:
            raise RequestError(f"structured_outputs.{unknown[0]} is not supported", f"structured_outputs.{unknown[0]}")
        found += [
            (k, outputs[k], f"structured_outputs.{k}")
            for k in sorted(STRUCTURED_KEYS)
            if outputs.get(k) not in (None, False)
        ]
    if not found:
        return None
    if len(found) > 1:
        raise RequestError(f"{found[0][2]} and {found[1][2]} cannot be combined: give one constraint", found[1][2])
    kind, value, field = found[0]
    if kind == "json":
        return json_schema(maybe_json(value, field), field)
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "choice":
        return choice(value, field)
    return text_grammar(kind, value, field)
