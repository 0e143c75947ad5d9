"""One preallocated KV cache for all user rows, plugged into transformers through its Cache interface.

Storage per layer is [rows, kv_heads, length, head_dim], allocated once at start-up. An int8 cache also
holds one float16 scale per row, head and position ([rows, kv_heads, length], for keys and for values):
each head vector is stored as round(x / s) with s = max |x| / 127, and read back as q * s. Before each forward
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
        scaled = dtype == torch.int8
        self.key_scales = [_zeros(shape[:3], torch.float16, device) for _ in range(num_layers if scaled else 0)]
        self.value_scales = [_zeros(shape[:3], torch.float16, device) for _ in range(num_layers if scaled else 0)]
        self.length = length
        self.dtype = dtype
        self._rows = slice(0, rows)
        self._write = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self._attend = 1
        self._flat: torch.Tensor | None = None  # the bound writes' rows of a [-1, head_dim] view, for update()

    @property
    def scratch(self) -> int:
        return self.length

    @property
    def write_positions(self) -> torch.Tensor:
        """[B, T] positions the bound forward writes to."""
        return self._write

    @property
    def rows_in_order(self) -> bool:
        """Whether the bound rows are 0..B-1 (a decode step): batch index b is then cache row b."""
        return isinstance(self._rows, slice) and self._rows.start == 0

    @property
    def nbytes(self) -> int:
        tensors = self.keys + self.values + self.key_scales + self.value_scales
        return sum(t.numel() * t.element_size() for t in tensors)

    def scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The key and value scales of an int8 cache's layer; (None, None) for other caches."""
        if not self.key_scales:
            return None, None
        return self.key_scales[layer_idx], self.value_scales[layer_idx]

    def bind(self, rows: slice | torch.Tensor, write_pos: torch.Tensor, attend_len: int) -> None:
        """Set the rows of the next forward (a slice: views, for decode; an index tensor: any rows, for
        prefill), where each new token is written ([B, T] positions) and how many positions it attends."""
        self._rows, self._write, self._attend = rows, write_pos, attend_len
        self._flat = None  # computed by the first update() of this forward, shared by every layer, K and V

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy positions 0..length-1 of row src into row dst, every layer, keys, values and scales."""
        for store in self.keys + self.values + self.key_scales + self.value_scales:
            store[dst, :, :length] = store[src, :, :length]

    def _flat_index(self) -> torch.Tensor:
        """For each bound row, head and new position, its row in a [-1, head_dim] view of a layer's store."""
        if self._flat is None:
            _, heads, length, _ = self.keys[0].shape
            device = self._write.device
            row_ids = self.bound_rows()
            heads_ids = torch.arange(heads, device=device)
            flat = (row_ids[:, None, None] * heads + heads_ids[None, :, None]) * length + self._write[:, None, :]
            self._flat = flat.reshape(-1)
        return self._flat

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the bound positions' keys and values [B, kv_heads, T, head_dim]; return the bound rows'
        first attend_len positions, read back in the states' dtype."""
        ks, vs = self.scales(layer_idx)
        return (self._update(self.keys[layer_idx], ks, key_states),
                self._update(self.values[layer_idx], vs, value_states))

    def _update(self, store: torch.Tensor, scales: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        dim = store.shape[-1]
        flat = self._flat_index()
        new = new.reshape(-1, dim)
        if scales is None:
            store.view(-1, dim).index_copy_(0, flat, new.to(store.dtype))
        else:
            q, s = quantize_heads(new)
            store.view(-1, dim).index_copy_(0, flat, q)
            scales.view(-1).index_copy_(0, flat, s)
        return self._read(store, scales, new.dtype)

    def bound_rows(self) -> torch.Tensor:
        """The bound rows' indices [B]."""
        if isinstance(self._rows, slice):
            return torch.arange(self._rows.start, self._rows.start + self._write.shape[0], device=self._write.device)
        return self._rows

    def read(self, layer_idx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The bound rows' first attend_len positions of a layer's keys and values: an int8 cache's in dtype,
        other caches' as they are stored."""
        ks, vs = self.scales(layer_idx)
        return self._read(self.keys[layer_idx], ks, dtype), self._read(self.values[layer_idx], vs, dtype)

    def _read(self, store: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        read = store[self._rows, :, :self._attend]
        if scales is None:
            return read
        return read.to(dtype) * scales[self._rows, :, :self._attend, None].to(dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._attend

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:
        return len(self.keys)


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and float16 scales of head vectors x [..., head_dim], as the CPU kernel stores them."""
    x = x.float()
    s = (x.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(s > 0, 1 / s.float(), 0)
    return (x * inv[..., None]).round().clamp(-127, 127).to(torch.int8), s
