"""One preallocated KV cache for all user rows (transformers' layers see it through hf_cache.BatchCache).

Storage per layer is [rows, kv_heads, slots, head_dim], allocated once at start-up: slots = the context's length,
or, for a sliding-window layer when the plan says so (``ExecutionPlan.kv_ring``), a ring of the window plus one
prefill chunk (position p at slot p % slots), as llama.cpp keeps its SWA layers; the attention kernel reads a
window's positions across the ring's wrap in position order. An int8 cache also
holds one float16 scale per row, head and position ([rows, kv_heads, length], for keys and for values):
each head vector is stored as round(x / s) with s = max |x| / 127, and read back as q * s; the layers it names
(``float_layers``: keys with outlier channels) stay float16, their scales empty. Nothing is bound to
the cache between calls: each forward passes its rows, the position each new token is written to and how many
positions attention reads (forward_batch.ForwardBatch). The last position is a scratch slot: rows in a decode
batch that have no token this step write there, and no row ever attends to it.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

from .plan import kv_slots


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed tensor. On CPU it lies in an anonymous memory map, which the kernel gives zeroed pages
    on first touch: a row's cache takes memory as its positions fill, not all at start-up."""
    count = 1
    for n in shape:
        count *= n
    if torch.device(device).type != "cpu" or count == 0:  # (a memory map cannot be empty)
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, count * dtype.itemsize)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


class RowKVCache:
    def __init__(
        self,
        num_layers: int,
        rows: int,
        kv_heads: int,
        length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        windows: Sequence[int | None] | None = None,
        chunk: int = 0,
        float_layers: Sequence[int] = (),
    ):
        """windows: each layer's sliding window, to keep those layers in rings of window + chunk slots (chunk:
        the most tokens one forward writes into a row: a prefill chunk's queries still read the window before
        it while the chunk is written); None: every layer as long as the context. float_layers: the layers of an
        int8 cache kept in float16 (their scales empty: [rows, kv_heads, 0], which nothing reads)."""
        self.windows = list(windows) if windows else [None] * num_layers
        # a ring's slots (position p at slot p % n), or the context's length
        self.layer_slots = kv_slots(self.windows, length, chunk)
        self.chunk = chunk if any(n < length for n in self.layer_slots) else 0
        self.keys, self.values, self.key_scales, self.value_scales = [], [], [], []
        scaled = dtype == torch.int8
        self.layer_dtypes = [torch.float16 if scaled and i in float_layers else dtype for i in range(num_layers)]
        for n, layer_dtype in zip(self.layer_slots, self.layer_dtypes):
            shape = (rows, kv_heads, n + 1, head_dim)  # +1: the scratch slot
            self.keys.append(_zeros(shape, layer_dtype, device))
            self.values.append(_zeros(shape, layer_dtype, device))
            if scaled:
                scales = shape[:3] if layer_dtype == torch.int8 else (rows, kv_heads, 0)
                self.key_scales.append(_zeros(scales, torch.float16, device))
                self.value_scales.append(_zeros(scales, torch.float16, device))
        self.length = length
        self.dtype = dtype

    @property
    def scratch(self) -> int:
        """The scratch slot of the layers as long as the context (padding writes there; rings never see padding:
        only the compact model's real tokens reach them)."""
        return self.length

    @property
    def nbytes(self) -> int:
        tensors = self.keys + self.values + self.key_scales + self.value_scales
        return sum(t.numel() * t.element_size() for t in tensors)

    def scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The key and value scales of an int8 cache's layer; (None, None) for other caches and layers."""
        if not self.key_scales or self.keys[layer_idx].dtype != torch.int8:
            return None, None
        return self.key_scales[layer_idx], self.value_scales[layer_idx]

    def ring(self, layer_idx: int) -> int:
        """The slots of a layer's ring (0: the layer is as long as the context)."""
        n = self.layer_slots[layer_idx]
        return n if n < self.length else 0

    def slots_of(self, slots: int, positions: torch.Tensor) -> torch.Tensor:
        """The slots positions are written at in layers of ``slots`` slots: a ring wraps, and the scratch position
        (an idle row's in a decode step) stays each layer's own scratch slot, never a ring's live one."""
        if slots == self.length:
            return positions
        return torch.where(positions == self.length, slots, positions % slots)

    def holds(self, cached: int, length: int) -> bool:
        """Whether a row that has written ``cached`` positions still holds what a request reusing its first
        ``length`` needs: each ring the window before position ``length`` (it holds the last n positions)."""
        return all(
            cached <= n or cached - n <= length - w
            for n, w in zip(self.layer_slots, self.windows)
            if n < self.length and w is not None  # (a ring is a window's)
        )

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy positions 0..length-1 of row src into row dst, every layer, keys, values and scales (a ring: its
        slots, which hold the window before length when ``holds`` said so)."""
        layers = len(self.layer_slots)
        for i, store in enumerate(self.keys + self.values + self.key_scales + self.value_scales):
            n = min(length, self.layer_slots[i % layers])
            store[dst, :, :n] = store[src, :, :n]

    def snapshot(self, row: int, length: int) -> list[torch.Tensor]:
        """A copy of a row's first ``length`` positions (a ring: its slots, as they are), every layer: keys, values
        and scales, for the prompt cache beyond the rows (prompt_cache.py)."""
        layers = len(self.layer_slots)
        stores = self.keys + self.values + self.key_scales + self.value_scales
        return [store[row, :, : min(length, self.layer_slots[i % layers])].clone() for i, store in enumerate(stores)]

    def restore(self, row: int, tensors: list[torch.Tensor]) -> None:
        """Write a snapshot back into a row (its positions from 0)."""
        stores = self.keys + self.values + self.key_scales + self.value_scales
        if len(tensors) != len(stores):
            raise ValueError("a snapshot of another cache layout")
        for store, saved in zip(stores, tensors):
            store[row, :, : saved.shape[1]] = saved.to(store.device)

    def flat_index(self, rows: torch.Tensor, write: torch.Tensor, slots: int | None = None) -> torch.Tensor:
        """For tokens [N] of cache rows ``rows`` written at slots ``write`` of layers with ``slots`` slots (None:
        the full layers): each head's row [N * kv_heads] in a [-1, head_dim] view of such a layer's store."""
        heads = self.keys[0].shape[1]
        length = (slots or self.length) + 1
        h = torch.arange(heads, device=rows.device)
        return ((rows[:, None] * heads + h) * length + write[:, None]).reshape(-1)

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, flat: torch.Tensor) -> None:
        """Store keys and values [N, kv_heads, head_dim] at flat (flat_index) of a layer."""
        ks, vs = self.scales(layer_idx)
        for store, scales, new in ((self.keys[layer_idx], ks, keys), (self.values[layer_idx], vs, values)):
            dim = store.shape[-1]
            new = new.reshape(-1, dim)
            if scales is None:
                store.view(-1, dim).index_copy_(0, flat, new.to(store.dtype))
            else:
                q, s = quantize_heads(new)
                store.view(-1, dim).index_copy_(0, flat, q)
                scales.view(-1).index_copy_(0, flat, s)

    def read(
        self, layer_idx: int, rows: torch.Tensor | slice, attend: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' first ``attend`` positions of a layer's keys and values [B, kv_heads, attend, head_dim]: an int8
        cache's in dtype, other caches' as they are stored."""
        ks, vs = self.scales(layer_idx)
        return (
            self._read(self.keys[layer_idx], ks, rows, attend, dtype),
            self._read(self.values[layer_idx], vs, rows, attend, dtype),
        )

    @staticmethod
    def _read(store, scales, rows, attend: int, dtype: torch.dtype) -> torch.Tensor:
        read = store[rows, :, :attend]
        if scales is None:
            return read
        return read.to(dtype) * scales[rows, :, :attend, None].to(dtype)


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and float16 scales of head vectors x [..., head_dim], as the CPU kernel stores them."""
    x = x.float()
    s = (x.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(s > 0, 1 / s.float(), 0)
    return (x * inv[..., None]).round().clamp(-127, 127).to(torch.int8), s
