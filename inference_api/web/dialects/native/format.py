"""Native answers: ``{"text", "finish_reason", "prompt_tokens", "completion_tokens"}``, or the text itself, chunk
by chunk, with no end marker."""

from __future__ import annotations

from collections.abc import Iterator

from ....engine.messages import TokenEvent
from ....request.generation import Generation, is_error


def answer(prefix: str, gen: Generation, prompt_tokens: int) -> dict:
    return {
        "text": prefix + gen.text,
        "finish_reason": gen.finish_reason.value if gen.finish_reason else None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": gen.completion_tokens,
    }


def text_stream(prefix: str, events: Iterator[TokenEvent]) -> Iterator[bytes]:
    if prefix:
        yield prefix.encode()
    for event in events:
        if is_error(event):
            raise RuntimeError(event.error)  # cut the chunked stream: the client sees an incomplete response
        if event.text:
            yield event.text.encode()
