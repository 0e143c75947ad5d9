"""A GGUF tensor's own blocks taken into the kernels' layouts (quant.py) without rounding any weight again.

- Q4_0, Q4_1 and Q4_K map onto the int4 layout (per 32 weights a float16 scale d, a float16 minimum m and 16
  bytes of nibbles, weights 0..15 in the low nibbles and 16..31 in the high ones; w = d * nibble + m):
  Q4_0 is d (nibble - 8), so m = -8 d; Q4_1 is the layout itself; a Q4_K super-block of 256 holds eight
  sub-blocks of 32 with 6-bit scales and minimums under a float16 d and dmin, so each sub-block's d is
  d x scale and its m is -dmin x min, rounded to float16 (about 2^-11 of themselves; the nibbles are exact).
- Q8_0 maps onto the int8 layout (groups of 32 with a scale): exact.

Other types (Q5_0, Q5_1, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_NL, ...) are dequantized and held as int8 groups of 32
(5 bits and more) or int4 blocks, which rounds them once more (issue 24 serves them in their own blocks).
"""
from __future__ import annotations

import numpy as np
import torch

from .quant import Int4Weight, Int8Weight

INT4_TYPES = {"Q4_0", "Q4_1", "Q4_K"}  # taken as they are into the int4 layout
INT8_TYPES = {"Q8_0"}  # taken as they are into the int8 layout


def _rows(t) -> tuple[int, int, np.ndarray]:
    """(rows, inputs per row, the raw bytes as [rows, bytes per row])."""
    n, k = int(t.shape[1]), int(t.shape[0])
    return n, k, np.asarray(t.data).view(np.uint8).reshape(n, -1)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def int4_weight(t) -> Int4Weight:
    """A Q4_0, Q4_1 or Q4_K tensor [N, K] as an Int4Weight."""
    n, k, raw = _rows(t)
    kind = t.tensor_type.name
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        blocks = raw.reshape(n, k // 32, size)
        d = _f16(blocks[..., 0:2])
        m = (d * np.float16(-8)) if kind == "Q4_0" else _f16(blocks[..., 2:4])
        q = blocks[..., size - 16:]  # the layout's own nibble order
    elif kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)
        sb = blocks.shape[0]
        dd, dmin = (_f16(blocks[:, i:i + 2]).astype(np.float32) for i in (0, 2))
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        d = (dd[:, None] * sc.astype(np.float32)).astype(np.float16)  # [super-blocks, 8]
        m = (-(dmin[:, None] * mn.astype(np.float32))).astype(np.float16)
        qs = blocks[:, 16:].reshape(sb, 4, 32)  # 64 weights per 32 bytes: low nibbles, then high nibbles
        v = np.stack([qs & 15, qs >> 4], axis=2).reshape(sb, 8, 32)  # each sub-block's 32 nibbles in order
        q = v[..., :16] | (v[..., 16:] << 4)
        d, m, q = d.reshape(n, k // 32), m.reshape(n, k // 32), q.reshape(n, k // 32, 16)
    else:
        raise ValueError(f"{kind} is not a 4-bit block type taken as it is")
    return Int4Weight(torch.from_numpy(np.ascontiguousarray(q).reshape(n, k // 2)),
                      torch.from_numpy(np.ascontiguousarray(d).reshape(n, k // 32)),
                      torch.from_numpy(np.ascontiguousarray(m).reshape(n, k // 32)))


def int8_weight(t) -> Int8Weight:
    """A Q8_0 tensor [N, K] as an Int8Weight (groups of 32)."""
    n, k, raw = _rows(t)
    blocks = raw.reshape(n, k // 32, 34)
    s = _f16(blocks[..., 0:2]).astype(np.float32)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
    return Int8Weight(torch.from_numpy(q.copy()), torch.from_numpy(np.ascontiguousarray(s)))


def packed(t) -> Int4Weight | Int8Weight | None:
    """The tensor's blocks as the kernels take them, or None when its type is not taken as it is."""
    kind = t.tensor_type.name
    if kind in INT4_TYPES:
        return int4_weight(t)
    if kind in INT8_TYPES:
        return int8_weight(t)
    return None


def cat(parts: list[Int4Weight | Int8Weight]) -> Int4Weight | Int8Weight:
    """Packed weights of one kind stacked along their rows (a fused QKV)."""
    if isinstance(parts[0], Int4Weight):
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m")))
    return Int8Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "s")))
