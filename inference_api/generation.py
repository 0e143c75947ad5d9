"""A whole generation gathered from a session's events, for the non-streaming endpoints."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

from .messages import FinishReason, TokenEvent, TokenLogprob
from .request_errors import Unavailable


@dataclass
class Generation:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0


def is_error(event: TokenEvent) -> bool:
    return event.finish_reason is FinishReason.ERROR


def all_events(first: TokenEvent | None, events: Iterator[TokenEvent]) -> Iterator[TokenEvent]:
    """The events again, the one ``first_event`` took included."""
    return itertools.chain([first] if first is not None else [], events)


def collect(first: TokenEvent | None, events: Iterator[TokenEvent]) -> Generation:
    gen, parts = Generation(), []
    for event in all_events(first, events):
        if event.finish_reason is FinishReason.ERROR:
            raise Unavailable(event.error or "generation failed", retry_after=5)
        parts.append(event.text)
        gen.token_ids.extend(event.token_ids)
        gen.logprobs.extend(event.logprobs)
        gen.finish_reason = event.finish_reason
        gen.completion_tokens = event.completion_tokens
        gen.cached_tokens = event.cached_tokens
    gen.text = "".join(parts)
    return gen
