"""The engine of an embedding model or a reranker: every request's inputs, from every team, in shared forwards.

Each step takes inputs round-robin over the open requests (one input of each in turn, so a request of a thousand
inputs never holds another's one input back for more than a step) until the step holds ``batch_tokens`` tokens
(``SHARED_STEP_TOKENS`` while several requests are open; packed, no padding), runs one forward of the encoder
(model/encoder.py) and sends each input's vector (or score) as its own event. An input's numbers do not depend on
what shares its forward (attention keeps each input to its own tokens). A generation request gets a clear error:
this model does not generate.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

import torch

from .messages import EmbedRequest, EngineStats, FinishReason, GenerateRequest, TokenEvent, packed_vector, refusal

log = logging.getLogger(__name__)

NOT_A_GENERATOR = "this server's model is an embedding model: use /v1/embeddings, /embed or /rerank"

# the tokens of a step while several requests are open (else ``batch_tokens``): short forwards on one thread, so
# that answers flow back to the web worker while the next forward runs, and the step's activations stay in the
# core's cache. On 2 cores, all-MiniLM-L6-v2 Q8_0 (about 22 tokens a text), 32 kept-alive clients in alternating
# 8 s loads: 651 to 703 texts/s against 582 to 636 with 512 (2026-11-29); 96 and 192 within the noise of 128.
SHARED_STEP_TOKENS = 128


class Embedder:
    def __init__(self, model, batch_tokens: int):
        self.model = model
        self.batch_tokens = max(batch_tokens, 1)
        self.pending: OrderedDict[str, deque[tuple[int, tuple[int, ...], bool]]] = OrderedDict()
        self.refused: list[TokenEvent] = []
        self.runner = None  # (the process loop closes a runner's other ranks: none here)
        self.embedded = 0
        self.threads = torch.get_num_threads()  # the configured threads (--torch-threads, else every core)

    @property
    def has_work(self) -> bool:
        return bool(self.pending or self.refused)

    @property
    def stats(self) -> EngineStats:
        return EngineStats(waiting=sum(len(q) for q in self.pending.values()))

    def add(self, request: GenerateRequest) -> None:
        self.refused.append(refusal(request.session_id, NOT_A_GENERATOR))

    def embed(self, request: EmbedRequest) -> None:
        self.pending[request.session_id] = deque((i, ids, request.normalize) for i, ids in enumerate(request.inputs))

    def cancel(self, session_id: str) -> None:
        self.pending.pop(session_id, None)

    def close(self) -> None:
        pass

    def _set_threads(self, requests: int) -> None:
        """Every configured thread for the forward of one request's inputs; one fewer while several requests are
        open, whose web work (tokens in, JSON out: one GIL-bound worker) needs a core of its own then. On 2 cores,
        32 kept-alive clients of all-MiniLM-L6-v2 Q8_0: 561 and 473 texts/s on one thread against 522 and 377 on
        two, whose second spins between parallel regions where the web worker would run (2026-11-29)."""
        threads = self.threads if requests <= 1 else max(1, self.threads - 1)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def step(self) -> list[TokenEvent]:
        events, self.refused = self.refused, []
        batch: list[tuple[str, int, tuple[int, ...], bool]] = []
        tokens, requests = 0, len(self.pending)
        limit = self.batch_tokens if requests <= 1 else min(self.batch_tokens, SHARED_STEP_TOKENS)
        while self.pending:
            took = False
            for sid, queue in list(self.pending.items()):
                i, ids, normalize = queue[0]
                if batch and tokens + len(ids) > limit:
                    continue
                queue.popleft()
                batch.append((sid, i, ids, normalize))
                tokens, took = tokens + len(ids), True
                if not queue:
                    del self.pending[sid]
            if not took:
                break
        if not batch:
            return events
        self._set_threads(requests)
        try:
            out = self.model.forward([list(ids) for _, _, ids, _ in batch])
        except Exception:
            log.exception("embedding forward failed")
            failed = {sid for sid, _, _, _ in batch}
            for sid in failed:
                self.pending.pop(sid, None)
            return events + [
                TokenEvent(sid, "", finish_reason=FinishReason.ERROR, error="engine error: the forward failed")
                for sid in failed
            ]
        for (sid, i, ids, normalize), vector in zip(batch, out):
            if normalize and not self.model.scores:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            events.append(
                TokenEvent(
                    sid,
                    "",
                    finish_reason=FinishReason.STOP,
                    prompt_tokens=len(ids),
                    index=i,
                    embedding=packed_vector(vector),
                )
            )
        self.embedded += len(batch)
        return events
