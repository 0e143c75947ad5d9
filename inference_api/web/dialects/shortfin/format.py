"""shortfin answers: ``GenerateReqOutput`` (or the generated token ids) and ``data(<rid>): ...`` stream events."""

from __future__ import annotations

from collections.abc import Iterator

from ....engine.messages import TokenEvent
from ....request.generation import Generation, is_error
from .protocol import ShortfinRequest


def answer(req: ShortfinRequest, gen: Generation) -> dict | list[int]:
    if req.return_input_ids:
        return gen.token_ids
    return {"responses": [{"prompt": req.text, "responses": [{"text": gen.text}]}]}


def stream(req: ShortfinRequest, events: Iterator[TokenEvent]) -> Iterator[bytes]:
    for event in events:
        if is_error(event):
            raise RuntimeError(event.error)  # cut the stream: shortfin has no in-band error event
        if req.return_input_ids:
            for token in event.token_ids:
                yield f"data({req.rid}): {token}\n\n".encode()
        elif event.text:
            yield f"data({req.rid}): {event.text}\n\n".encode()
    yield b"data: [DONE]\n\n"
