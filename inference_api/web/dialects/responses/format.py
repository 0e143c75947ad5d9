"""Response objects of the Responses API, field for field, and their stream of typed events: response.created,
response.in_progress, then per output item response.output_item.added, (a reasoning model's thought: a reasoning
item) response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
response.content_part.done, (a message) response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done, (a function call)
response.function_call_arguments.delta..., response.function_call_arguments.done, and response.output_item.done;
last response.completed (or response.incomplete at max_output_tokens). Every event has a ``sequence_number``.
An engine failure after the stream has started becomes a response.failed event and ends it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

from ....engine.messages import FinishReason, TokenEvent
from ....request.generation import Generation
from ....request.tools import CallSplitter, ToolCall, Tools, offered, split_calls
from ...sse import sse


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseFormat:
    def __init__(self, model: str, echo: dict, tools: Tools | None, previous_response_id: str | None, store: bool):
        self.id = _id("resp")
        self.created = int(time.time())
        self.model = model
        self.echo = echo
        self.tools = offered(tools)
        self.previous_response_id = previous_response_id
        self.store = store

    def envelope(self, status: str, output: list[dict], usage: dict | None, finish: FinishReason | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if finish is FinishReason.LENGTH else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": incomplete,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            **self.echo,
        }

    def items(self, text: str | None, calls: list[ToolCall], thought: str = "") -> list[dict]:
        out = [reasoning_item(_id("rs"), thought, "completed")] if thought else []
        if text:
            out.append(message_item(_id("msg"), text, "completed"))
        out += [call_item(c, "completed") for c in calls]
        return out

    def response(self, gen: Generation, prompt_tokens: int) -> dict:
        text: str | None = gen.text
        calls: list[ToolCall] = []
        if self.tools is not None:
            text, calls = split_calls(gen.text, self.tools.names, self.tools.forced)
        status = "incomplete" if gen.finish_reason is FinishReason.LENGTH else "completed"
        usage_ = usage(prompt_tokens, gen.completion_tokens, gen.cached_tokens, gen.reasoning_tokens)
        return self.envelope(status, self.items(text, calls, gen.reasoning), usage_, gen.finish_reason)

    def stream(self, events: Iterator[TokenEvent], prompt_tokens: int, done: Callable[[dict], None]) -> Iterator[bytes]:
        """The SSE body; ``done`` gets the final response object (to store it)."""
        splitter = CallSplitter(self.tools.names, incremental=self.tools.forced) if self.tools is not None else None
        seq = 0
        output: list[dict] = []  # items done
        current: dict | None = None  # the item being streamed
        text_parts: list[str] = []

        def emit(kind: str, **data) -> bytes:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **data}
            seq += 1
            return sse(payload, event=kind)

        def close() -> Iterator[bytes]:
            nonlocal current
            if current is None:
                return
            index = len(output)
            if current["type"] in ("reasoning", "message"):
                text = "".join(text_parts)
                where = {"item_id": current["id"], "output_index": index, "content_index": 0}
                part: dict
                if current["type"] == "reasoning":
                    part = {"type": "reasoning_text", "text": text}
                    yield emit("response.reasoning_text.done", **where, text=text)
                    current = reasoning_item(current["id"], text, "completed")
                else:
                    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                    yield emit("response.output_text.done", **where, text=text, logprobs=[])
                    current = message_item(current["id"], text, "completed")
                yield emit("response.content_part.done", **where, part=part)
            else:
                current = {**current, "status": "completed"}
                yield emit(
                    "response.function_call_arguments.done",
                    item_id=current["id"],
                    output_index=index,
                    name=current["name"],
                    arguments=current["arguments"],
                )
            yield emit("response.output_item.done", output_index=index, item=current)
            output.append(current)
            current = None

        def open_item(item: dict) -> Iterator[bytes]:
            nonlocal current
            yield from close()
            current = item
            yield emit("response.output_item.added", output_index=len(output), item=item)
            if item["type"] in ("message", "reasoning"):
                text_parts.clear()
                part = (
                    {"type": "output_text", "text": "", "annotations": []}
                    if item["type"] == "message"
                    else {"type": "reasoning_text", "text": ""}
                )
                yield emit(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=len(output),
                    content_index=0,
                    part=part,
                )

        def delta(kind: str, text: str) -> Iterator[bytes]:
            """More of the answer's text (``message``) or of the thought's (``reasoning``), in an item of its kind."""
            if not text:
                return
            if current is None or current["type"] != kind:
                opened = message_item(_id("msg"), "", "in_progress", content=False) if kind == "message" else None
                yield from open_item(opened or reasoning_item(_id("rs"), "", "in_progress"))
            assert current is not None
            text_parts.append(text)
            where = {"item_id": current["id"], "output_index": len(output), "content_index": 0}
            if kind == "message":
                yield emit("response.output_text.delta", **where, delta=text, logprobs=[])
            else:
                yield emit("response.reasoning_text.delta", **where, delta=text)

        def arguments(text: str) -> Iterator[bytes]:
            assert current is not None
            current["arguments"] += text
            yield emit(
                "response.function_call_arguments.delta", item_id=current["id"], output_index=len(output), delta=text
            )

        def pieces(text: str, finished: bool) -> Iterator[bytes]:
            if splitter is None:
                yield from delta("message", text)
                return
            for piece in splitter.take(text, finished):
                match piece:
                    case ("content", str() as content):
                        yield from delta("message", content)
                    case ("call", ToolCall() as call):
                        yield from open_item(call_item(ToolCall(call.id, call.name, ""), "in_progress"))
                        yield from arguments(call.arguments)
                    case ("open", (str() as call_id, str() as name)):
                        yield from open_item(call_item(ToolCall(call_id, name, ""), "in_progress"))
                    case ("arguments", str() as partial):
                        yield from arguments(partial)
                    case _:  # "end": the call is whole
                        yield from close()

        yield emit("response.created", response=self.envelope("in_progress", [], None))
        yield emit("response.in_progress", response=self.envelope("in_progress", [], None))
        output_tokens = cached = thought_tokens = 0
        for ev in events:
            if ev.finish_reason is FinishReason.ERROR:
                failed = self.envelope("failed", output, None)
                failed["error"] = {"code": "server_error", "message": ev.error or "generation failed"}
                yield emit("response.failed", response=failed)
                return
            output_tokens, cached, thought_tokens = (
                ev.completion_tokens,
                ev.cached_tokens or cached,
                ev.reasoning_tokens,
            )
            yield from delta("reasoning", ev.reasoning)
            yield from pieces(ev.text, ev.finished)
            if ev.finished:
                if ev.finish_reason not in (FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH):
                    return  # cancelled: nobody is listening
                yield from close()
                status = "incomplete" if ev.finish_reason is FinishReason.LENGTH else "completed"
                totals = usage(prompt_tokens, output_tokens, cached, thought_tokens)
                final = self.envelope(status, output, totals, ev.finish_reason)
                done(final)
                yield emit(f"response.{status}", response=final)
                return


def message_item(item_id: str, text: str, status: str, content: bool = True) -> dict:
    parts = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if content else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": parts}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """A reasoning model's thought, as the Responses API returns open models' reasoning: its text as
    ``reasoning_text`` content (no summary)."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def call_item(call: ToolCall, status: str) -> dict:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat form's assistant turn (what a later previous_response_id shows)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output
        if i["type"] == "function_call"
    ]
    if calls:
        return [{"role": "assistant", "content": text or None, "tool_calls": calls}]
    return [{"role": "assistant", "content": text}]
