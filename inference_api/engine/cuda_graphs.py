"""The decode step replayed from CUDA graphs, one per batch-size bucket (as nano-vllm and vLLM capture theirs).

A decode step on CUDA is hundreds of small kernel launches from Python (the embedded model's 30 layers of norms,
linears, rotary, cache writes and attention: 1,139 measured on an H100 before each RMSNorm became one kernel); run
eagerly there, a step of one row took about as long as one of 32, and replayed from a graph about a sixth of that
(docs/performance.md).
Here each bucket's step is captured once at start-up over static tensors: the inputs (token, position and cache
write of rows 0..B-1), the KV cache (allocated once, never moved) and the logits the graph writes. A step then
copies its inputs from one pinned host buffer in one transfer and replays the bucket's graph; sampling runs on
the GPU from those logits and only the new token ids come back (Engine._sample). The graphs share one memory pool.
``decode_ahead`` launches the next step from the sampled tokens before the host reads them, so the GPU's step
n + 1 runs while the host detokenizes step n (Engine._launch_ahead says when).

The captured forward is the compact model's static decode batch (ForwardBatch.static): every row of the bucket
is computed, idle ones writing to the cache's scratch slot, and attention reads a fixed span of positions under a
mask, so nothing depends on the step's contents. Each batch size is captured for a few spans (256, 512, ... up to
the context's length) and a step replays the shortest that holds its longest row: short rows do not pay for
reading every row's whole context. ``capture=False`` runs the same static step eagerly (any device):
what the tests compare the graphs with, and what a step runs if a capture failed.

A step with LoRA adapter rows (one adapter a row; model/lora.py's ``LoraRows``) replays graphs of its own, each
captured at the first such step of its bucket and span: each row's place in the adapter stacks is a fourth column
of the inputs (a row without an adapter reads the stacks' zeros) and its scale one more static input. Loading or
unloading an adapter rebuilds the stacks, so those graphs are dropped and captured again when next needed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


def bucket_sizes(rows: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every multiple of 8, and the row count itself."""
    sizes = [n for n in (1, 2, 4) if n < rows] + list(range(8, rows, 8)) + [rows]
    return sorted(set(sizes))


def span_sizes(length: int) -> list[int]:
    """The attention spans captured: 256, 512, 1024, ... below the context's length, and the length itself."""
    spans, n = [], 256
    while n < length:
        spans.append(n)
        n *= 2
    return spans + [length]


class DecodeGraphs:
    """decode(rows, tokens, positions) -> logits [len(rows), V], as ModelRunner.decode, from the captured graphs."""

    def __init__(self, model, cache, rows: int, device: torch.device, capture: bool = True):
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.sizes, self.spans = bucket_sizes(rows), span_sizes(cache.length)
        # rows x (token, position, cache write, adapter place): the graphs read these, a step overwrites them in
        # one copy; and each row's adapter scale (a step with adapter rows copies it too)
        pinned = self.device.type == "cuda"
        self.inputs = torch.zeros(rows, 4, dtype=torch.long, device=self.device)
        self.inputs[:, 2] = cache.scratch  # capture and warm-up write to the scratch slot only
        self.staged = torch.zeros(rows, 4, dtype=torch.long, pin_memory=pinned)
        self.scales = torch.zeros(rows, 1, device=self.device)
        self.staged_scales = torch.zeros(rows, 1, pin_memory=pinned)
        self.copied: torch.cuda.Event | None = None  # the last copy out of staged (staged is rewritten after it)
        # decode_ahead: the sampled tokens' copy to the host, and the step it launched
        self.host_tokens = torch.zeros(rows, dtype=torch.long, pin_memory=pinned)
        self.ahead: _Ahead | None = None
        self.launched_ahead = self.used_ahead = 0  # steps decode_ahead launched, and of them the steps decode used
        self.rows = {n: torch.arange(n, device=self.device) for n in self.sizes}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (batch size, span)
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None  # the graphs' shared memory pool
        # steps with adapter rows: their graphs by (batch size, span), and the stacks' generation they read
        self.lora_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.lora_logits: dict[tuple[int, int], torch.Tensor] = {}
        self.lora_generation = -1
        self.capture_lora = capture  # (False after a failed capture: those steps run eagerly)
        if capture:
            self._capture()

    @property
    def captured(self) -> list[int]:
        """The batch sizes replayed from graphs."""
        return sorted({size for size, _ in self.graphs})

    def _batch(self, size: int, span: int, lora: bool = False) -> ForwardBatch:
        """A fresh static batch over the first size rows of the inputs, attending to span positions (fresh: its
        masks are computed by the forward that reads it, inside the graph); with ``lora``, the rows' adapters."""
        ids, positions, write = (self.inputs[:size, i : i + 1] for i in range(3))
        return ForwardBatch(
            ids,
            positions,
            write,
            self.rows[size],
            span,
            self.cache.scratch,
            decode=True,
            static=True,
            lora_rows=(self.inputs[:size, 3], self.scales[:size]) if lora else None,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        """Capture every bucket, the largest first (the smaller ones then fit in its pool). Each is run once on
        a side stream first, so lazy initialisations (cuBLAS handles, kernel loads) happen outside the capture."""
        for key in [(size, span) for size in reversed(self.sizes) for span in reversed(self.spans)]:
            self.graphs[key], self.logits[key] = self._capture_one(*key)
        torch.cuda.synchronize(self.device)

    def _capture_one(self, size: int, span: int, lora: bool = False) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """One bucket's step captured in the shared pool (run once on a side stream first); the graph and the
        logits it writes."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.model.forward(self._batch(size, span, lora), self.cache)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward(self._batch(size, span, lora), self.cache)
        self.pool = graph.pool()
        return graph, logits

    def takes(self, adapters: list[tuple[tuple[int, float], ...]]) -> bool:
        """Whether a step of rows with these adapters (each row's (slot, scale) pairs) is replayed: one adapter a
        row at most, held in the matmuls' stacks (a row of several runs eagerly)."""
        lora = getattr(self.model, "lora", None)
        return lora is not None and lora.kernels is None and all(len(pairs) <= 1 for pairs in adapters)

    @torch.inference_mode()
    def decode(
        self,
        rows: list[int],
        tokens: list[int],
        positions: list[int],
        adapters: list[tuple[tuple[int, float], ...]] | None = None,
    ) -> torch.Tensor:
        """The step's logits; ``adapters``: each row's (slot, scale) pairs where some row has one (``takes``)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and adapters is None and ahead.matches(rows, tokens, positions):  # (the last step's)
            self.used_ahead += 1
            return ahead.logits
        return self._run(*self._stage(rows, tokens, positions, adapters), lora=adapters is not None)

    @torch.inference_mode()
    def decode_ahead(self, rows: list[int], tokens: torch.Tensor, positions: list[int]) -> Callable[[], list[int]]:
        """Launch the next step of these rows from the tokens just sampled, still on the device, before the host
        reads them: the GPU computes step n + 1 while the host turns step n into text. Returns what reads the
        tokens back (it waits for their copy alone, not for the launched step). decode then returns the launched
        step's logits when it is asked for exactly these rows, tokens and positions; any other step is computed
        afresh, over what the launched one wrote (the same keys and values at the same positions, or positions
        past a row's end, which no request reads)."""
        host = self.host_tokens[: len(rows)]
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event() if self.device.type == "cuda" else None
        if copied is not None:
            copied.record()
        size, span, where = self._stage(rows, None, positions)
        self.inputs[where, 0] = tokens
        self.ahead = _Ahead(list(rows), list(positions), host, self._run(size, span, where))
        self.launched_ahead += 1

        def read() -> list[int]:
            if copied is not None:
                copied.synchronize()
            return host.tolist()

        return read

    def _stage(
        self,
        rows: list[int],
        tokens: list[int] | None,
        positions: list[int],
        adapters: list[tuple[tuple[int, float], ...]] | None = None,
    ) -> tuple[int, int, torch.Tensor | slice]:
        """The bucket and span that hold these rows, and their inputs (token, position, cache write, adapter place;
        idle rows 0, 0, scratch, the stacks' zeros) built on the host as one table, written to the pinned buffer
        and copied to the graphs' in one transfer (tokens None: left 0, for decode_ahead to fill on the device);
        with ``adapters`` (each row's (slot, scale) pairs, one at most), their scales too. Returns (size, span,
        where): the rows' places in the bucket, on the device (a slice when they are all of them, in order)."""
        size = next(n for n in self.sizes if n > max(rows))
        span = next(n for n in self.spans if n > max(positions))
        lora = self.model.lora if adapters is not None else None
        zero = lora.zero_place if lora is not None else 0
        table = [(0, 0, self.cache.scratch, zero)] * size
        scales = [0.0] * size
        for i, (row, token, position) in enumerate(zip(rows, tokens or [0] * len(rows), positions)):
            place = zero
            if lora is not None and adapters is not None and adapters[i]:
                ((slot, scales[row]),) = adapters[i]
                place = lora.position[slot]
            table[row] = (token, position, position, place)
        if self.copied is not None:  # (the engine has read the last step's tokens by now: already complete)
            self.copied.synchronize()
        self.staged[:size] = torch.tensor(table)
        self.inputs[:size].copy_(self.staged[:size], non_blocking=True)
        if lora is not None:
            self.staged_scales[:size, 0] = torch.tensor(scales)
            self.scales[:size].copy_(self.staged_scales[:size], non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()
        where = slice(0, size) if rows == list(range(size)) else torch.tensor(rows).to(self.device, non_blocking=True)
        return size, span, where

    def _run(self, size: int, span: int, where: torch.Tensor | slice, lora: bool = False) -> torch.Tensor:
        """The staged step: its graph replayed (or the static step run eagerly); the rows' logits [len(rows), V].
        With ``lora``, the adapter rows' graph, captured now if this bucket and span has none yet (those captured
        over adapter stacks since rebuilt dropped first)."""
        graphs, outputs = (self.lora_graphs, self.lora_logits) if lora else (self.graphs, self.logits)
        if lora and self.lora_generation != self.model.lora.generation:  # captured over stacks since rebuilt
            graphs.clear()
            outputs.clear()
            self.lora_generation = self.model.lora.generation
        key = (size, span)
        if lora and key not in graphs and self.capture_lora:
            try:
                graphs[key], outputs[key] = self._capture_one(size, span, lora=True)
            except Exception:  # (the step then runs eagerly, as it did before adapters had graphs)
                log.warning("capturing a decode step with adapter rows failed: such steps run eagerly", exc_info=True)
                self.capture_lora = False
        graph = graphs.get(key)
        if graph is not None:
            graph.replay()
            logits = outputs[key]
        else:
            logits = self.model.forward(self._batch(size, span, lora), self.cache)
        return logits[where]


@dataclass
class _Ahead:
    """A step decode_ahead launched: its rows, positions, tokens (read back by the time it is matched), logits."""

    rows: list[int]
    positions: list[int]
    tokens: torch.Tensor
    logits: torch.Tensor

    def matches(self, rows: list[int], tokens: list[int], positions: list[int]) -> bool:
        return rows == self.rows and positions == self.positions and tokens == self.tokens.tolist()


def capture_decode(model, cache, rows: int, device: torch.device) -> DecodeGraphs | None:
    """The captured decode step, or None (eager decoding, with a warning) where the capture fails."""
    try:
        return DecodeGraphs(model, cache, rows, device)
    except Exception:
        log.warning("capturing the decode step in CUDA graphs failed: it runs eagerly", exc_info=True)
        return None
