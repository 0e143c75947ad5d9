"""Chat answers of a request with tools (``tools.py``): the model's calls as ``message.tool_calls`` with
``finish_reason: "tool_calls"`` and ``content: null``, and streamed as OpenAI streams them: per call a delta
with its ``index``, ``id``, ``type`` and ``function.name`` (``arguments: ""``), then one with its
``function.arguments``. Text that may still become a call is held back until it is known."""
from __future__ import annotations

from ...generation import Generation
from ...messages import EngineReady, TokenLogprob
from ...tools import CallSplitter, Tools, split_calls
from .format import ChatFormat


class ToolChatFormat(ChatFormat):
    def __init__(self, ready: EngineReady, want_logprobs: bool, tools: Tools):
        super().__init__(ready, want_logprobs)
        self.splitter = CallSplitter(tools.names)
        self.calls = 0  # calls streamed so far: the next one's index
        self.held: tuple[TokenLogprob, ...] = ()  # log-probs of text held back, sent with the next chunk

    def response(self, gen: Generation, prompt_tokens: int) -> dict:
        body = super().response(gen, prompt_tokens)
        content, calls = split_calls(gen.text, self.splitter.names)
        if calls:
            choice = body["choices"][0]
            choice["message"].update(content=content, tool_calls=[c.openai() for c in calls])
            if choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        return body

    def chunks(self, text: str, logprobs: tuple[TokenLogprob, ...], finish: str | None) -> list[dict]:
        pieces = self.splitter.feed(text) if text else []
        if finish is not None:
            pieces += self.splitter.finish()
        lps, out = self.held + tuple(logprobs), []
        for kind, piece in pieces:
            if kind == "content":
                out.append(self.chunk(piece, lps, None))
            else:
                index, self.calls = self.calls, self.calls + 1
                opening = {"index": index, "id": piece.id, "type": "function",
                           "function": {"name": piece.name, "arguments": ""}}
                out.append(self._delta({"tool_calls": [opening]}, lps))
                out.append(self._delta({"tool_calls": [{"index": index, "function": {"arguments": piece.arguments}}]},
                                       ()))
            lps = ()
        self.held = lps if finish is None else ()
        if finish is not None:
            out.append(self.chunk("", lps, "tool_calls" if finish == "stop" and self.calls else finish))
        return out

    def _delta(self, delta: dict, lps: tuple[TokenLogprob, ...]) -> dict:
        logprobs = self.logprobs(lps) if self.want_logprobs else None
        return self.envelope(self.chunk_object, [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                  "finish_reason": None}])
