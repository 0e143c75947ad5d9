"""Reasoning models, with no transport: how a model's thought is marked (a parser, chosen by ``--reasoning-parser``
or, with ``auto``, by what the chat template shows), and what the engine is told of one request's thought
(``messages.Reasoning``: where it starts, its budget, the tokens that close it, whether it goes out apart).

The parsers, after vLLM's of the same names: ``deepseek_r1`` (DeepSeek-R1 and its distills: the model always
thinks, so its output starts inside the thought whether or not it writes ``<think>``) and ``qwen3`` (Qwen3 and
other templates with think tags: a thought when the model opens one, or when the chat template ended the prompt
inside one, as the thinking-only templates do). The engine finds the thought in the output (engine/reasoning.py);
the chat APIs (OpenAI chat, Responses, Messages) return it apart unless ``--reasoning-format none``; the other
APIs return the text as written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import ServerConfig
from ..engine.messages import Reasoning, SamplingParams
from ..model.tokenizer import Tokenizer
from ..request_errors import RequestError

PROMPT_TAIL = 16  # prompt tokens read to see whether the chat template opened a thought


@dataclass(frozen=True)
class Parser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    always: bool = False  # the model always thinks: its output starts inside a thought


PARSERS = {p.name: p for p in (Parser("deepseek_r1", always=True), Parser("qwen3"))}
CHOICES = ("auto", *PARSERS, "none")


def choose_parser(name: str, chat_template: str | None) -> Parser | None:
    """The parser ``--reasoning-parser`` names; ``auto``: the one the chat template calls for (a template that
    writes no end tag has none; DeepSeek's turn markers: deepseek_r1; any other: qwen3)."""
    if name == "none":
        return None
    if name != "auto":
        return PARSERS[name]
    if not chat_template or PARSERS["qwen3"].end not in chat_template:
        return None
    return PARSERS["deepseek_r1"] if "<｜Assistant｜>" in chat_template else PARSERS["qwen3"]


@dataclass(frozen=True)
class Thinking:
    """What a request asks of a thought: returned apart or in the text (its dialect's way), and its budget."""

    split: bool = False
    budget: int | None = None  # thought tokens before the close is forced (None: the server's budget)


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning effort


def effort_budget(value, field: str) -> int | None:
    """OpenAI's reasoning effort as a thought budget: ``none`` closes the thought at once (0); the others are
    accepted and leave the server's budget (None)."""
    if value is None:
        return None
    if value not in EFFORTS:
        raise RequestError(f"{field} must be one of {', '.join(EFFORTS)}", field)
    return 0 if value == "none" else None


def budget_field(value, field: str, minimum: int = 0) -> int | None:
    """A request's thought budget: a whole number of tokens, at least ``minimum`` (None: not given)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestError(f"{field} must be a whole number of tokens, at least {minimum}", field)
    return value


def engine_reasoning(
    parser: Parser | None,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    thinking: Thinking,
    *,
    format_none: bool = False,
    server_budget: int = -1,
    budget_message: str = "",
) -> Reasoning | None:
    """The engine's ``Reasoning`` of a chat request (None: the model does not think)."""
    if parser is None:
        return None
    tail = tokenizer.decode(list(prompt_ids[-PROMPT_TAIL:])).rstrip()
    budget = thinking.budget if thinking.budget is not None else (server_budget if server_budget >= 0 else None)
    close = tokenizer.encode(budget_message + parser.end, add_special_tokens=False)  # as llama-server writes it
    return Reasoning(
        start=parser.start,
        end=parser.end,
        inside=parser.always or tail.endswith(parser.start),
        budget=budget,
        close_ids=tuple(close),
        split=thinking.split and not format_none,
    )


def with_reasoning(
    params: SamplingParams,
    config: ServerConfig,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    thinking: Thinking | None = None,
) -> SamplingParams:
    """A chat request's parameters with its thought's ``Reasoning`` (unchanged when the model does not think):
    the server's parser, format and budget, and the request's ``thinking``."""
    parser = choose_parser(config.reasoning_parser, tokenizer.chat_template)
    reasoning = engine_reasoning(
        parser,
        tokenizer,
        prompt_ids,
        thinking or Thinking(),
        format_none=config.reasoning_format == "none",
        server_budget=config.reasoning_budget,
        budget_message=config.reasoning_budget_message,
    )
    return params if reasoning is None else dataclasses.replace(params, reasoning=reasoning)
