"""transformers' Cache interface over the rows' KV cache, for the layers of an architecture the compact decoder
does not describe (model_runner's fallback); imported only there, so that the engine of a GGUF never imports
transformers."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from .kv_cache import RowKVCache


class BatchCache(Cache):
    """transformers' Cache interface over a RowKVCache for one ForwardBatch, made per forward and dropped."""

    def __init__(self, cache: RowKVCache, batch):
        super().__init__(layers=[])
        self.cache, self.batch = cache, batch
        rows = batch.rows.repeat_interleave(batch.ids.shape[1])
        self.flat = cache.flat_index(rows, batch.write.reshape(-1))  # every [B, T] token, padding to scratch

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the batch's keys and values [B, kv_heads, T, head_dim]; return its rows' first attend
        positions, read back in the states' dtype."""
        k, v = (s.transpose(1, 2).reshape(-1, *s.shape[1:2], s.shape[-1]) for s in (key_states, value_states))
        self.cache.write(layer_idx, k, v, self.flat)
        return self.cache.read(layer_idx, self.batch.rows, self.batch.attend, key_states.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.batch.attend

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.cache.length

    def __len__(self) -> int:
        return len(self.cache.keys)
