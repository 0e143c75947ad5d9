"""TGI answers: ``{"generated_text", "details"}`` (in a list on ``/``) and the stream's token events."""

from __future__ import annotations

from collections.abc import Iterator

from lifecycle.error_shapes import TGI, error_body

from ....engine.messages import FinishReason, TokenEvent, TokenLogprob
from ....request.generation import Generation
from ...sse import sse
from .protocol import TgiRequest

FINISH: dict[FinishReason | None, str] = {
    FinishReason.EOS: "eos_token",
    FinishReason.STOP: "stop_sequence",
    FinishReason.LENGTH: "length",
}


def _token(token_id: int, text: str, logprob: float | None, special: bool) -> dict:
    return {"id": token_id, "text": text, "logprob": logprob, "special": special}


def answer(req: TgiRequest, gen: Generation) -> dict:
    text = (req.inputs if req.return_full_text else "") + gen.text
    if not req.details:
        return {"generated_text": text}
    last = len(gen.token_ids) - 1
    tokens = [
        _token(tid, lp.token, lp.logprob, i == last and gen.finish_reason is FinishReason.EOS)
        for i, (tid, lp) in enumerate(zip(gen.token_ids, gen.logprobs))
    ]
    return {
        "generated_text": text,
        "details": {
            "finish_reason": FINISH.get(gen.finish_reason, "length"),
            "generated_tokens": gen.completion_tokens,
            "seed": req.seed,
            "prefill": [],
            "tokens": tokens,
        },
    }


def stream(req: TgiRequest, events: Iterator[TokenEvent]) -> Iterator[bytes]:
    """One SSE event per engine event (its text, its last token); the last one carries the full text."""
    parts = [req.inputs] if req.return_full_text else []
    for event in events:
        if event.finish_reason is FinishReason.ERROR:
            yield sse(error_body(TGI, 500, event.error or "generation failed"))
            return
        if event.finished and event.finish_reason not in FINISH:
            return  # cancelled: nobody is listening
        ids, lps, text = event.token_ids or (0,), event.logprobs, event.text
        eos = event.finish_reason is FinishReason.EOS
        if eos and text and len(ids) > 1:
            # text held back until the end token: send it on its own, as clients skip special tokens' text
            parts.append(text)
            yield sse(_stream_event(event.completion_tokens - 1, ids[-2], text, lps[-2] if len(lps) > 1 else None))
            text = ""
        parts.append(text)
        body = _stream_event(event.completion_tokens, ids[-1], text, lps[-1] if lps else None, special=eos)
        if event.finished:
            body["generated_text"] = "".join(parts)
            body["details"] = {
                "finish_reason": FINISH[event.finish_reason],
                "generated_tokens": event.completion_tokens,
                "seed": req.seed,
            }
        yield sse(body)


def _stream_event(index: int, token_id: int, text: str, lp: TokenLogprob | None, special: bool = False) -> dict:
    return {
        "index": index,
        "token": _token(token_id, text, lp.logprob if lp else None, special),
        "top_tokens": None,
        "generated_text": None,
        "details": None,
    }
