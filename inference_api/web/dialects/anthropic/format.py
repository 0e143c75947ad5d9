"""Anthropic's Messages objects, field for field: the message (a reasoning model's ``thinking`` block, text and
``tool_use`` blocks, stop_reason, usage) and its stream of typed events: message_start, then per block
content_block_start, its deltas (``thinking_delta``, ``text_delta``, a call's ``input_json_delta``) and
content_block_stop, then message_delta (stop_reason, usage) and message_stop. An engine failure after the stream has
started becomes an ``error`` event and ends it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

from lifecycle.error_shapes import ANTHROPIC, error_body

from ....engine.messages import FinishReason, TokenEvent
from ....request.generation import Generation
from ....request.tools import CallSplitter, ToolCall, Tools, offered, split_calls
from ...sse import sse

STOP_REASON: dict[FinishReason | None, str] = {
    FinishReason.EOS: "end_turn",
    FinishReason.STOP: "stop_sequence",
    FinishReason.LENGTH: "max_tokens",
}


def tool_use(call: ToolCall) -> dict:
    """A call as a ``tool_use`` block (its input the arguments' object)."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


class MessageFormat:
    def __init__(self, model: str, tools: Tools | None, stop_sequences: tuple[str, ...]):
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.tools = offered(tools)
        self.stop_sequences = stop_sequences

    def stop(self, reason: FinishReason | None, calls: bool, text: str = "") -> tuple[str, str | None]:
        """(stop_reason, stop_sequence): tool_use when the answer ends in calls; the stop sequence matched where
        only one could have (the engine does not say which of several ended it)."""
        if calls and reason in (FinishReason.EOS, FinishReason.STOP):
            return "tool_use", None
        stop_reason = STOP_REASON.get(reason, "end_turn")
        sequence = self.stop_sequences[0] if stop_reason == "stop_sequence" and len(self.stop_sequences) == 1 else None
        return stop_reason, sequence

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def response(self, gen: Generation, prompt_tokens: int) -> dict:
        text: str | None = gen.text
        calls: list[ToolCall] = []
        if self.tools is not None:
            text, calls = split_calls(gen.text, self.tools.names, self.tools.forced)
        content = [thinking_block(gen.reasoning)] if gen.reasoning else []
        content += ([{"type": "text", "text": text}] if text else []) + [tool_use(c) for c in calls]
        stop_reason, sequence = self.stop(gen.finish_reason, bool(calls))
        return self.message(
            content, stop_reason, sequence, usage(prompt_tokens, gen.completion_tokens, gen.cached_tokens)
        )


def thinking_block(text: str) -> dict:
    """A reasoning model's thought (its signature empty: the thought is the model's own text, not Anthropic's)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """Anthropic's usage: input_tokens counts what was computed, cache_read_input_tokens what the prefix cache
    held (their sum is the prompt)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stream_events(fmt: MessageFormat, events: Iterator[TokenEvent], prompt_tokens: int) -> Iterator[bytes]:
    """The SSE body of a streamed message."""
    splitter = CallSplitter(fmt.tools.names, incremental=fmt.tools.forced) if fmt.tools is not None else None
    index, open_kind, calls = -1, None, 0
    output_tokens = cached = 0

    def event(kind: str, data: dict) -> bytes:
        return sse({"type": kind, **data}, event=kind)

    def close() -> Iterator[bytes]:
        nonlocal open_kind
        if open_kind is not None:
            yield event("content_block_stop", {"index": index})
            open_kind = None

    def start(block: dict) -> Iterator[bytes]:
        nonlocal index, open_kind
        yield from close()
        index += 1
        open_kind = block["type"]
        yield event("content_block_start", {"index": index, "content_block": block})

    def text_delta(text: str) -> Iterator[bytes]:
        if not text:
            return
        if open_kind != "text":
            yield from start({"type": "text", "text": ""})
        yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": text}})

    def thought_delta(text: str) -> Iterator[bytes]:
        if open_kind != "thinking":
            yield from start(thinking_block(""))
        yield event("content_block_delta", {"index": index, "delta": {"type": "thinking_delta", "thinking": text}})

    def arguments(text: str) -> bytes:
        return event(
            "content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": text}}
        )

    def pieces(text: str, finished: bool) -> Iterator[bytes]:
        nonlocal calls
        if splitter is None:
            yield from text_delta(text)
            return
        for piece in splitter.take(text, finished):
            match piece:
                case ("content", str() as content):
                    yield from text_delta(content)
                case ("call", ToolCall() as call):
                    yield from start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                    yield arguments(call.arguments)
                    calls += 1
                case ("open", (str() as call_id, str() as name)):
                    yield from start({"type": "tool_use", "id": call_id, "name": name, "input": {}})
                case ("arguments", str() as partial):
                    yield arguments(partial)
                case _:  # "end": the call streamed since its opening is whole
                    calls += 1

    opening = fmt.message([], None, None, usage(prompt_tokens, 0))
    yield event("message_start", {"message": opening})
    for ev in events:
        if ev.finish_reason is FinishReason.ERROR:
            yield sse(error_body(ANTHROPIC, 500, ev.error or "generation failed"), event="error")
            return
        output_tokens, cached = ev.completion_tokens, ev.cached_tokens or cached
        if ev.reasoning:
            yield from thought_delta(ev.reasoning)
        yield from pieces(ev.text, ev.finished)
        if ev.finished:
            if ev.finish_reason not in STOP_REASON:
                return  # cancelled: nobody is listening
            yield from close()
            stop_reason, sequence = fmt.stop(ev.finish_reason, calls > 0)
            final = usage(prompt_tokens, output_tokens, cached)
            yield event(
                "message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": sequence}, "usage": final}
            )
            yield event("message_stop", {})
            return
