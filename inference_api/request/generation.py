"""A whole generation gathered from a session's events, for the non-streaming endpoints."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..engine.messages import FinishReason, TokenEvent, TokenLogprob
from ..request_errors import Unavailable


@dataclass
class Generation:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first None), if asked for
    reasoning: str = ""  # a reasoning model's thought, when it goes out apart (``text`` is the answer)
    reasoning_tokens: int = 0  # the output's tokens that were its thought


def is_error(event: TokenEvent) -> bool:
    return event.finish_reason is FinishReason.ERROR


def all_events(first: TokenEvent | None, events: Iterator[TokenEvent]) -> Iterator[TokenEvent]:
    """The events again, the one ``first_event`` took included."""
    return itertools.chain([first] if first is not None else [], events)


def collect(first: TokenEvent | None, events: Iterator[TokenEvent]) -> Generation:
    return collect_choices(first, events, 1)[0]


def collect_choices(first: TokenEvent | None, events: Iterator[TokenEvent], n: int) -> list[Generation]:
    """Each of a request's n choices gathered from its events (``TokenEvent.index``); the prompt's log-probs, if
    asked for, land on choice 0."""
    gens = [Generation() for _ in range(n)]
    parts: list[list[str]] = [[] for _ in range(n)]
    thoughts: list[list[str]] = [[] for _ in range(n)]
    for event in all_events(first, events):
        if event.finish_reason is FinishReason.ERROR:
            raise Unavailable(event.error or "generation failed", retry_after=5)
        gen = gens[event.index]
        parts[event.index].append(event.text)
        thoughts[event.index].append(event.reasoning)
        gen.reasoning_tokens = event.reasoning_tokens
        gen.token_ids.extend(event.token_ids)
        gen.logprobs.extend(event.logprobs)
        gen.finish_reason = event.finish_reason
        gen.completion_tokens = event.completion_tokens
        gen.cached_tokens = event.cached_tokens
        if event.prompt_logprobs is not None:
            gen.prompt_logprobs = list(event.prompt_logprobs)
    for gen, texts, thought in zip(gens, parts, thoughts):
        gen.text, gen.reasoning = "".join(texts), "".join(thought)
    return gens
