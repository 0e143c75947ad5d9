"""llama-stack answers: ``CompletionResponse`` ``{content, stop_reason, logprobs}``, ``ChatCompletionResponse``
``{completion_message: {role, content, stop_reason, tool_calls}, logprobs}``, and the stream chunks
``{delta, stop_reason, logprobs}`` and ``{event: {event_type, delta, stop_reason, logprobs}}``."""
from __future__ import annotations

import json
from typing import Iterator

from ...generation import Generation, is_error
from ...messages import FinishReason, TokenEvent, TokenLogprob
from ..openai.format import visible

STOP_REASON = {FinishReason.EOS: "end_of_turn", FinishReason.STOP: "end_of_turn", FinishReason.LENGTH: "out_of_tokens"}


def _logprobs_out(lps: tuple[TokenLogprob, ...]) -> list[dict]:
    return [{"logprobs_by_token": {lp.token: lp.logprob, **dict(lp.top)}} for lp in lps]


def answer(gen: Generation, chat: bool, want_logprobs: bool) -> dict:
    lps = _logprobs_out(visible(gen.logprobs, gen.finish_reason)) if want_logprobs else None
    reason = STOP_REASON.get(gen.finish_reason, "out_of_tokens")
    if chat:
        return {"completion_message": {"role": "assistant", "content": gen.text, "stop_reason": reason,
                                       "tool_calls": []}, "logprobs": lps}
    return {"content": gen.text, "stop_reason": reason, "logprobs": lps}


def ndjson(obj: dict) -> bytes:
    """One JSON object per line: the stream framing for clients that do not accept server-sent events."""
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def stream(events: Iterator[TokenEvent], chat: bool, want_logprobs: bool) -> Iterator[dict]:
    """The stream's chunks, each to be framed (``sse`` or ``ndjson``)."""
    def chunk(event_type: str, delta: str, lps, reason: str | None) -> dict:
        lps = _logprobs_out(lps) if want_logprobs and lps else None
        if chat:
            return {"event": {"event_type": event_type, "delta": delta, "logprobs": lps, "stop_reason": reason}}
        return {"delta": delta, "logprobs": lps, "stop_reason": reason}

    if chat:
        yield chunk("start", "", (), None)
    for event in events:
        if is_error(event):
            yield {"error": {"message": event.error or "generation failed"}}
            return
        lps = visible(event.logprobs, event.finish_reason)
        if event.text:
            yield chunk("progress", event.text, lps, None)
            lps = ()
        if event.finished:
            if event.finish_reason not in STOP_REASON:
                return  # cancelled: nobody is listening
            yield chunk("complete", "", lps, STOP_REASON[event.finish_reason])
