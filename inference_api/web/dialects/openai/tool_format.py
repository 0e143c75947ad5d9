"""Chat answers of a request with tools (``tools.py``): the model's calls as ``message.tool_calls`` with
``finish_reason: "tool_calls"`` and ``content: null``, and streamed as OpenAI streams them: per call a delta
with its ``index``, ``id``, ``type`` and ``function.name`` (``arguments: ""``), then its ``function.arguments``:
as the model writes them when the call is forced (``required``, a named function: the grammar guarantees the
call), in one delta once the call is whole otherwise. Text that may still become a call is held back until it
is known."""

from __future__ import annotations

from ....engine.messages import EngineReady, TokenLogprob
from ....request.generation import Generation
from ....request.tools import CallSplitter, ToolCall, Tools, split_calls
from .format import ChatFormat


class ToolChatFormat(ChatFormat):
    def __init__(self, ready: EngineReady, want_logprobs: bool, tools: Tools):
        super().__init__(ready, want_logprobs)
        self.splitter = CallSplitter(tools.names, incremental=tools.forced)
        self.calls = 0  # calls streamed so far: the next one's index
        self.held: tuple[TokenLogprob, ...] = ()  # log-probs of text held back, sent with the next chunk

    def response(self, gen: Generation, prompt_tokens: int) -> dict:
        body = super().response(gen, prompt_tokens)
        content, calls = split_calls(gen.text, self.splitter.names, self.splitter.incremental)
        if calls:
            choice = body["choices"][0]
            choice["message"].update(content=content, tool_calls=[c.openai() for c in calls])
            if choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        return body

    def chunks(self, text: str, logprobs: tuple[TokenLogprob, ...], finish: str | None) -> list[dict]:
        pieces = self.splitter.take(text, finish is not None)
        lps, out = self.held + tuple(logprobs), []
        for piece in pieces:
            match piece:
                case ("content", str() as text):
                    out.append(self.chunk(text, lps, None))
                case ("call", ToolCall() as call):
                    out += [self._opening(call.id, call.name, lps), self._arguments(call.arguments)]
                    self.calls += 1
                case ("open", (str() as call_id, str() as name)):
                    out.append(self._opening(call_id, name, lps))
                case ("arguments", str() as text):
                    out.append(self._arguments(text, lps))
                case _:  # "end": the call streamed since its opening is whole
                    self.calls += 1
                    continue
            lps = ()
        self.held = lps if finish is None else ()
        if finish is not None:
            out.append(self.chunk("", lps, "tool_calls" if finish == "stop" and self.calls else finish))
        return out

    def _opening(self, call_id: str, name: str, lps: tuple[TokenLogprob, ...]) -> dict:
        """A call's first delta; the call is ``self.calls`` until its arguments are done."""
        opening = {"index": self.calls, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        return self._delta({"tool_calls": [opening]}, lps)

    def _arguments(self, text: str, lps: tuple[TokenLogprob, ...] = ()) -> dict:
        return self._delta({"tool_calls": [{"index": self.calls, "function": {"arguments": text}}]}, lps)

    def _delta(self, delta: dict, lps: tuple[TokenLogprob, ...]) -> dict:
        logprobs = self.logprobs(lps) if self.want_logprobs else None
        return self.envelope(
            self.chunk_object, [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}]
        )
