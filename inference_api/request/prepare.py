"""Request preparation, with no transport: the step between a parsed request and the engine, the same for every
HTTP dialect (through ``Serving``) and for the offline ``LLM``.

A dialect's parser gives sampling parameters, a prompt (``Prompt``: text, token ids or chat messages) and
``max_tokens`` (None: as many as fit); here the prompt becomes token ids (``encode``), ``max_tokens`` gets its
default, the prompt and the output must fit the context, and the engine's ``SamplingParams`` are built
(``engine_params``); ``prepare`` does both. Everything wrong raises ``request_errors``' plain errors.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine.messages import SamplingParams
from ..model.tokenizer import Tokenizer
from ..request_errors import RequestError
from .tools import Tools, offered, plain_messages

# max_tokens when the request has none (OpenAI, llama-stack, the offline API): as many as fit, at most this many
DEFAULT_MAX_TOKENS = 1024
# characters a request's text may have per context token (64 KiB at least) before anything is tokenized: more can
# never fit a request (no vocabulary makes a token of 16 characters on average), and tokenizing a 1 MB prompt
# took over a second of a web worker's CPU for what could only be refused
CHARS_PER_TOKEN = 16
MIN_CHAR_LIMIT = 1 << 16


def char_limit(context_length: int) -> int:
    """The characters a prompt (or a grammar) may have for this context length."""
    return max(MIN_CHAR_LIMIT, CHARS_PER_TOKEN * context_length)


def check_chars(length: int, context_length: int, name: str | None, what: str = "the prompt") -> None:
    """RequestError if ``length`` characters are over ``char_limit``."""
    limit = char_limit(context_length)
    if length > limit:
        raise RequestError(
            f"{what} is {length} characters long; at most {limit} are taken ({CHARS_PER_TOKEN} per token of the "
            f"{context_length}-token context)",
            name,
        )


def check_prompt_size(prompt: Prompt, context_length: int) -> None:
    """The character cap on a prompt before it is tokenized: its text, or its messages and tools as JSON."""
    if prompt.ids is not None:
        return
    if prompt.messages is None:
        check_chars(len(prompt.text or ""), context_length, "prompt")
        return
    length = len(json.dumps(list(prompt.messages), ensure_ascii=False, default=str))
    if prompt.tools:
        length += len(json.dumps(list(prompt.tools), ensure_ascii=False, default=str))
    check_chars(length, context_length, prompt.field, "the messages with their tools")


@dataclass(frozen=True)
class Prompt:
    """What the model continues: token ids as given, text to encode, or messages for the chat template."""

    text: str | None = None
    ids: Sequence[int] | None = None
    messages: Sequence[dict] | None = None
    field: str = "messages"  # the request field a chat template's refusal names
    tools: Sequence[dict] | None = None  # function tools shown to the model (tools.Tools.tools), with messages

    @classmethod
    def chat(cls, messages: Sequence[dict], tools: Tools | None = None) -> Prompt:
        """A conversation, with the tools it offers shown to the model (none with tool_choice none)."""
        shown = offered(tools)
        return cls(messages=messages, tools=shown.tools if shown is not None else None)


# model names that clients made for TGI send whatever the server serves: TGI's documented "tgi", and "dummy",
# which huggingface_hub's InferenceClient sends when it is given the server's URL (TGI and llama-server ignore
# the name; this server takes these two in the OpenAI API's request bodies as its first model)
PLACEHOLDER_MODELS = ("tgi", "dummy")


def encode(tokenizer: Tokenizer, prompt: Prompt) -> list[int]:
    """The prompt's token ids."""
    if prompt.ids is not None:
        return list(prompt.ids)
    if prompt.messages is None:
        if prompt.text is None:
            raise ValueError("a Prompt has text, ids or messages")
        return tokenizer.encode(prompt.text)
    from jinja2 import TemplateError

    messages = list(prompt.messages)
    try:
        if getattr(tokenizer, "handles_tools", False):  # the template takes tools and calls as they are
            return tokenizer.encode_chat(messages, tools=list(prompt.tools) if prompt.tools else None)
        if prompt.tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages = plain_messages(messages, prompt.tools)
        return tokenizer.encode_chat(messages)
    except TemplateError as err:  # e.g. a template that insists on alternating user/assistant turns
        raise RequestError(f"messages do not fit the model's chat template: {err}", prompt.field) from None


def fit_inputs(inputs: list[list[int]], context_length: int, truncate: bool, field: str) -> list[list[int]]:
    """Inputs to embed or score, each within the model's context: cut to it with ``truncate``, else a
    RequestError naming the first too long."""
    for i, ids in enumerate(inputs):
        if len(ids) > context_length and not truncate:
            raise RequestError(
                f"{field}[{i}] is {len(ids)} tokens long; the model takes at most {context_length} (or ask to "
                f"truncate)",
                field,
            )
    return [ids[:context_length] for ids in inputs]


def engine_params(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    context_length: int,
    *,
    default_max: int = DEFAULT_MAX_TOKENS,
    field: str = "max_tokens",
    prompt_field: str | None = None,
) -> SamplingParams:
    """``params`` with max_tokens filled in (None: as many as fit, at most ``default_max``), once the prompt and
    the output are known to fit the context. ``field``: the request's name for max_tokens; ``prompt_field``: the
    field an empty prompt's error names (the HTTP APIs name none)."""
    if not prompt_ids:
        raise RequestError("the prompt is empty (no tokens)", prompt_field)
    if params.grammar is not None:  # compiled in the engine: its size bounded before it is queued
        check_chars(len(params.grammar.text), context_length, None, "the request's grammar (its schema)")
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(default_max, context_length - len(prompt_ids)))
    if len(prompt_ids) + max_tokens > context_length:
        raise RequestError(
            f"prompt ({len(prompt_ids)} tokens) plus {field} ({max_tokens}) exceeds the context "
            f"length of {context_length} tokens",
            field,
        )
    return dataclasses.replace(params, max_tokens=max_tokens)


def prepare(
    tokenizer: Tokenizer,
    context_length: int,
    prompt: Prompt,
    params: SamplingParams,
    *,
    default_max: int = DEFAULT_MAX_TOKENS,
    field: str = "max_tokens",
    prompt_field: str | None = None,
) -> tuple[list[int], SamplingParams]:
    """(prompt ids, engine parameters): ``check_prompt_size``, ``encode``, then ``engine_params``."""
    check_prompt_size(prompt, context_length)
    prompt_ids = encode(tokenizer, prompt)
    return prompt_ids, engine_params(
        prompt_ids, params, context_length, default_max=default_max, field=field, prompt_field=prompt_field
    )
