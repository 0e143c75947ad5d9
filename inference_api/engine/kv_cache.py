"""One preallocated KV cache for all user rows, plugged into transformers through its Cache interface.

Storage per layer is [rows, kv_heads, length, head_dim], allocated once at start-up. Before each forward
the runner binds a contiguous slice of rows, the position each new token is written to, and how many
positions attention reads. The last position is a scratch slot: rows in a decode batch that have no
token this step write there, and no row ever attends to it.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache


class RowKVCache(Cache):
    def __init__(self, num_layers: int, rows: int, kv_heads: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(layers=[])
        shape = (rows, kv_heads, length + 1, head_dim)  # +1: the scratch slot
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = length
        self._rows = slice(0, rows)
        self._write = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self._attend = 1

    @property
    def scratch(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def bind(self, rows: slice, write_pos: torch.Tensor, attend_len: int) -> None:
        """Set where the next forward writes ([B, T] positions per row) and how far it attends."""
        self._rows, self._write, self._attend = rows, write_pos, attend_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.keys[layer_idx][self._rows]
        v = self.values[layer_idx][self._rows]
        idx = self._write[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        k.scatter_(2, idx, key_states.to(k.dtype))
        v.scatter_(2, idx, value_states.to(v.dtype))
        return k[:, :, :self._attend], v[:, :, :self._attend]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._attend

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:
        return len(self.keys)
