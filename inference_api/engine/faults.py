"""For tests only: an Engine that fails the post-processing of requests whose prompt contains a given text, to
show that one request's failure leaves every other stream intact (TEST_FAULT_TEXT)."""

from __future__ import annotations

from .engine import Engine
from .messages import GenerateRequest, TokenEvent, TokenLogprob
from .sequence import Sequence


class FaultyEngine(Engine):
    def __init__(self, *args, fault_text: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.fault_text = fault_text
        self._faulty: set[str] = set()

    def add(self, request: GenerateRequest) -> None:
        if self.fault_text in self.tokenizer.decode(request.prompt_ids):
            self._faulty.add(request.session_id)
        super().add(request)

    def _advance(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> list[TokenEvent]:
        if seq.session_id in self._faulty:
            self._faulty.discard(seq.session_id)
            raise RuntimeError("injected post-processing fault (TEST_FAULT_TEXT)")
        return super()._advance(seq, token, logprob)
