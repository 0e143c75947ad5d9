"""One preallocated KV cache for all user rows, plugged into transformers through its Cache interface.

Storage per layer is [rows, kv_heads, length, head_dim], allocated once at start-up. Before each forward
the runner binds a contiguous slice of rows, the position each new token is written to, and how many
positions attention reads. The last position is a scratch slot: rows in a decode batch that have no
token this step write there, and no row ever attends to it.
"""
from __future__ import annotations

import mmap
from typing import Any

import torch
from transformers.cache_utils import Cache


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed tensor. On CPU it lies in an anonymous memory map, which the kernel gives zeroed pages
    on first touch: a row's cache takes memory as its positions fill, not all at start-up."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = 1
    for n in shape:
        count *= n
    buffer = mmap.mmap(-1, count * dtype.itemsize)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


class RowKVCache(Cache):
    def __init__(self, num_layers: int, rows: int, kv_heads: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(layers=[])
        shape = (rows, kv_heads, length + 1, head_dim)  # +1: the scratch slot
        self.keys = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.values = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.length = length
        self.dtype = dtype
        self._rows = slice(0, rows)
        self._write = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self._attend = 1

    @property
    def scratch(self) -> int:
        return self.length

    @property
    def write_positions(self) -> torch.Tensor:
        """[B, T] positions the bound forward writes to."""
        return self._write

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
        rows, heads, length, dim = store.shape
        first = self._rows.start if isinstance(self._rows, slice) else None
        row_ids = (torch.arange(first, first + new.shape[0], device=store.device) if first is not None
                   else self._rows)
        heads_ids = torch.arange(heads, device=store.device)
        flat = (row_ids[:, None, None] * heads + heads_ids[None, :, None]) * length + self._write[:, None, :]
        store.view(-1, dim).index_copy_(0, flat.reshape(-1), new.reshape(-1, dim).to(store.dtype))
        return store[self._rows, :, :self._attend]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._attend

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:
        return len(self.keys)
