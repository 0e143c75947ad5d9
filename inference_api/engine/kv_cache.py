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

    def bind(self, rows: slice | torch.Tensor, write_pos: torch.Tensor, attend_len: int) -> None:
        """Set the rows of the next forward (a slice: views, for decode; an index tensor: any rows, for
        prefill), where each new token is written ([B, T] positions) and how many positions it attends."""
        self._rows, self._write, self._attend = rows, write_pos, attend_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return (self._update(self.keys[layer_idx], key_states), self._update(self.values[layer_idx], value_states))

    def _update(self, store: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        if isinstance(self._rows, slice):
            view = store[self._rows]
            idx = self._write[:, None, :, None].expand(-1, view.shape[1], -1, view.shape[3])
            view.scatter_(2, idx, new.to(view.dtype))
            return view[:, :, :self._attend]
        rows = self._rows[:, None]
        store[rows, :, self._write] = new.transpose(1, 2).to(store.dtype)  # [B, T, heads, dim]
        return store[self._rows, :, :self._attend]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._attend

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:
        return len(self.keys)
