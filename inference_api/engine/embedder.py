"""The engine of an embedding model or a reranker: every request's inputs, from every team, in shared forwards.

Each step takes inputs round-robin over the open requests (one input of each in turn, so a request of a thousand
inputs never holds another's one input back for more than a step) until the step holds ``batch_tokens`` tokens
(``SHARED_STEP_TOKENS`` while several requests are open; packed, no padding), runs the encoder over them
(model/encoder.py) and sends each input's vector (or score) as its own event: one forward on every configured thread
while one request is open; while several are, a forward of one thread on each core at once, over its share of the
step's inputs (no parallel region between the cores, so the web worker taking a core for a while stalls only the
forward there). An input's numbers do not depend on what shares its forward (attention keeps each input to its own
tokens). A generation request gets a clear error: this model does not generate.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

import torch

from .messages import EmbedRequest, EngineStats, FinishReason, GenerateRequest, TokenEvent, packed_vector, refusal

log = logging.getLogger(__name__)

NOT_A_GENERATOR = "this server's model is an embedding model: use /v1/embeddings, /embed or /rerank"

# the tokens of each core's forward while several requests are open (else ``batch_tokens`` for the step): short
# forwards on one thread, so that answers flow back to the web worker while the next forward runs, and the step's
# activations stay in the core's cache. On 2 cores, all-MiniLM-L6-v2 Q8_0 (about 22 tokens a text), 32 kept-alive
# clients in alternating 8 s loads: 651 to 703 texts/s against 582 to 636 with 512 (2026-11-29); 96 and 192 within
# the noise of 128.
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
        # a forward a core while several requests are open (the kernels let go of the GIL while they run)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="forward") if self.threads > 1 else None

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
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    def _forward(self, inputs: list[list[int]], shared: bool) -> torch.Tensor:
        """The step's vectors [inputs, dims]: one forward on every configured thread (one request open), else the
        inputs split in order into a part a thread (about equal tokens), each part a forward of one thread, all at
        once. Before, several requests took one forward on one thread fewer than configured (two threads' parallel
        regions waited at each barrier for the core the web worker had taken): on 2 cores, 32 kept-alive clients of
        all-MiniLM-L6-v2 Q8_0 made 184 to 206 texts/s at the AVX2 level, one core's forward rate, where a forward a
        core makes 282 to 290; 417 to 425 against 457 to 481 at the AVX-512 level (2026-11-30)."""
        pool = self.pool if shared else None
        parts = _split(inputs, self.threads) if pool is not None else [inputs]
        if pool is None or len(parts) == 1:
            _use_threads(self.threads)
            return self.model.forward(inputs)
        _use_threads(1)
        return torch.cat([f.result() for f in [pool.submit(self.model.forward, part) for part in parts]])

    def step(self) -> list[TokenEvent]:
        events, self.refused = self.refused, []
        batch: list[tuple[str, int, tuple[int, ...], bool]] = []
        tokens, requests = 0, len(self.pending)
        limit = self.batch_tokens if requests <= 1 else min(self.batch_tokens, SHARED_STEP_TOKENS * self.threads)
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
        try:
            out = self._forward([list(ids) for _, _, ids, _ in batch], requests > 1)
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


def _use_threads(n: int) -> None:
    """torch's intra-op threads for the next forward (set only when they change: the call restarts the pool)."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _split(inputs: list[list[int]], n: int) -> list[list[list[int]]]:
    """The inputs in order in at most n non-empty parts of about equal tokens."""
    total = sum(len(ids) for ids in inputs)
    parts: list[list[list[int]]] = [[]]
    done = 0
    for ids in inputs:
        if parts[-1] and len(parts) < n and done >= total * len(parts) / n:
            parts.append([])
        parts[-1].append(ids)
        done += len(ids)
    return parts
