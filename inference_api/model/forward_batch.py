"""The explicit batch one forward runs on, built by the runner from the scheduler's step and handed to the model
(as gpt-fast passes ``input_pos``): nothing about a forward is left on the cache or the model between calls.

Entries are laid out [B, T]: each entry is one row's chunk of tokens, left-padded so that every entry's last
token is last. ``write`` says where each token's key and value go in its row's cache; padding (and an idle
row of a decode step) writes to the cache's scratch position, which no row ever attends to.

A static decode batch (``static``) computes every row 0..B-1 as a token, idle ones included, and attends over
a fixed ``attend`` under a mask: no shape depends on the batch's contents and nothing is read back to the host,
so the step can be captured in a CUDA graph and replayed over the same tensors (engine/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class ForwardBatch:
    ids: torch.Tensor  # [B, T] token ids (0 in padding)
    positions: torch.Tensor  # [B, T] each token's position in its row (0 in padding)
    write: torch.Tensor  # [B, T] the cache position each token writes (the scratch position for padding)
    rows: torch.Tensor  # [B] each entry's cache row
    attend: int  # how many cached positions attention reads (the longest entry's end)
    scratch: int  # the cache's scratch position
    decode: bool = False  # one token for each of rows 0..B-1 (the decode kernels' layout; idle rows padding)
    last_only: bool = True  # logits of each entry's last token only ([B, V]); else of every token ([B, T, V])
    hidden: bool = False  # the final norm's output instead of the logits (an embedding: --embedding)
    static: bool = False  # a decode batch whose every row counts as a token (CUDA graphs; see above)
    # each entry's LoRA adapters as (slot, scale) pairs (model/lora.py); None: no entry has one
    adapters: list[tuple[tuple[int, float], ...]] | None = None
    # a static step's per-entry adapter (places, scales) as model/lora.py's LoraRows (CUDA graphs' inputs)
    lora_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    _masks: dict = field(default_factory=dict, repr=False)

    # what the forward reads, computed when first read (the decode kernels' step reads none of the token views)
    @cached_property
    def real(self) -> torch.Tensor:
        """[B, T] which entries are tokens (not padding, not an idle row)."""
        return self.write != self.scratch

    @cached_property
    def tokens(self) -> torch.Tensor:
        """[N] the real tokens' indices into B * T (a static batch: every entry's)."""
        if self.static:
            return torch.arange(self.ids.numel(), device=self.ids.device)
        return self.real.reshape(-1).nonzero()[:, 0]

    @cached_property
    def token_rows(self) -> torch.Tensor:
        """[N] each real token's cache row."""
        return self.rows.repeat_interleave(self.ids.shape[1])[self.tokens]

    @cached_property
    def token_positions(self) -> torch.Tensor:
        return self.positions.reshape(-1)[self.tokens]

    @cached_property
    def token_writes(self) -> torch.Tensor:
        return self.write.reshape(-1)[self.tokens]

    def adapter_tokens(self) -> list[tuple[int, int, float]]:
        """(token, slot, scale) for every real token of an entry with adapters, the token as an index into the real
        tokens (an entry's are consecutive there, in order)."""
        if not self.adapters or not any(self.adapters):
            return []
        counts = self.real.sum(1).tolist()
        pairs, start = [], 0
        for n, adapters in zip(counts, self.adapters):
            pairs += [(start + j, slot, scale) for slot, scale in adapters for j in range(n)]
            start += n
        return pairs

    @property
    def shape(self) -> tuple[int, int]:
        return self.ids.shape[0], self.ids.shape[1]

    @property
    def last(self) -> torch.Tensor:
        """[B] each entry's last real token, as an index into the real tokens (chunks are left-padded)."""
        if self.static:
            return torch.arange(self.ids.shape[0], device=self.ids.device)
        return self.real.sum(1).cumsum(0) - 1

    @property
    def cache_rows(self) -> torch.Tensor | slice:
        """The cache rows attention reads, for RowKVCache.read: a decode step's rows 0..B-1 as a slice (a view of
        the cache, not a copy)."""
        return slice(0, self.ids.shape[0]) if self.decode else self.rows

    def visible(self, window: int | None = None) -> torch.Tensor:
        """[B, T, attend] which cached positions each token attends to: its row's positions up to its own (the
        last ``window`` of them for a sliding-window layer); padding sees position 0 only."""
        if window not in self._masks:
            keys = torch.arange(self.attend, device=self.ids.device)
            pos = self.positions[..., None]
            seen = keys <= pos
            if window is not None:
                seen &= keys > pos - window
            self._masks[window] = torch.where(self.real[..., None], seen, keys == 0)
        return self._masks[window]

    def lengths(self) -> torch.Tensor:
        """[B] a decode step's positions attended per row (its position + 1; 1 for an idle row, which sees
        position 0 only)."""
        return torch.where(self.real[:, 0], self.positions[:, 0] + 1, 1)
