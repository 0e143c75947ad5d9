"""llama-stack answers: ``CompletionResponse`` ``{content, stop_reason, logprobs}``, ``ChatCompletionResponse``
``{completion_message: {role, content, stop_reason, tool_calls}, logprobs}``, and the stream chunks
``{delta, stop_reason, logprobs}`` and ``{event: {event_type, delta, stop_reason, logprobs}}``. With tools, the
model's calls (``tools.py``) are ToolCalls ``{call_id, tool_name, arguments}``, streamed each as one progress
event whose delta is ``{content: ToolCall, parse_status: "success"}``, and the stop reason is
``end_of_message`` (as Llama's ``<|eom_id|>`` after a call). A call that does not parse (a forced call cut off by
max_tokens) is text, as llama-stack's own server gives it: the answer's content, and in a stream one event
``{content: its text, parse_status: "failure"}``; the stop reason says ``out_of_tokens``."""

from __future__ import annotations

import json
from collections.abc import Iterator

from ....engine.messages import FinishReason, TokenEvent, TokenLogprob
from ....request.generation import Generation, is_error
from ....request.tools import OPEN, CallSplitter, Piece, ToolCall, Tools, split_calls
from ..openai.format import visible

STOP_REASON: dict[FinishReason | None, str] = {
    FinishReason.EOS: "end_of_turn",
    FinishReason.STOP: "end_of_turn",
    FinishReason.LENGTH: "out_of_tokens",
}


def _logprobs_out(lps: tuple[TokenLogprob, ...]) -> list[dict]:
    return [{"logprobs_by_token": {lp.token: lp.logprob, **dict(lp.top)}} for lp in lps]


def _tool_call(call: ToolCall) -> dict:
    return {"call_id": call.id, "tool_name": call.name, "arguments": json.loads(call.arguments)}


def _called(reason: str) -> str:
    """The stop reason of an answer that holds calls."""
    return "end_of_message" if reason == "end_of_turn" else reason


def answer(gen: Generation, chat: bool, want_logprobs: bool, tools: Tools | None = None) -> dict:
    lps = _logprobs_out(visible(gen.logprobs, gen.finish_reason)) if want_logprobs else None
    reason = STOP_REASON.get(gen.finish_reason, "out_of_tokens")
    if chat:
        content, calls = split_calls(gen.text, tools.names) if tools is not None else (gen.text, [])
        return {
            "completion_message": {
                "role": "assistant",
                "content": content or "",
                "stop_reason": _called(reason) if calls else reason,
                "tool_calls": [_tool_call(c) for c in calls],
            },
            "logprobs": lps,
        }
    return {"content": gen.text, "stop_reason": reason, "logprobs": lps}


def ndjson(obj: dict) -> bytes:
    """One JSON object per line: the stream framing for clients that do not accept server-sent events."""
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def stream(events: Iterator[TokenEvent], chat: bool, want_logprobs: bool, tools: Tools | None = None) -> Iterator[dict]:
    """The stream's chunks, each to be framed (``sse`` or ``ndjson``)."""
    splitter = CallSplitter(tools.names) if tools is not None else None

    def chunk(event_type: str, delta, lps, reason: str | None) -> dict:
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
        if splitter is None:
            pieces: list[Piece] = [("content", event.text)] if event.text else []
        else:
            pieces = splitter.feed(event.text) + (splitter.finish() if event.finished else [])
        for piece in pieces:
            delta: str | dict[str, object]
            match piece:
                case ("call", ToolCall() as call):
                    delta = {"content": _tool_call(call), "parse_status": "success"}
                case ("content", str() as text) if text.startswith(OPEN):  # a call that did not parse (cut off
                    delta = {"content": text, "parse_status": "failure"}  # by max_tokens): its text
                case ("content", str() as text):
                    delta = text
                case _:  # (only an incremental splitter's pieces: this one is not)
                    continue
            yield chunk("progress", delta, lps, None)
            lps = ()
        if event.finished:
            if event.finish_reason not in STOP_REASON:
                return  # cancelled: nobody is listening
            reason = STOP_REASON[event.finish_reason]
            yield chunk("complete", "", lps, _called(reason) if splitter is not None and splitter.calls else reason)
