"""A GGUF tensor's own blocks taken as the kernels serve them, without rounding any weight again.

- Q4_0 and Q4_1 map onto quant.py's int4 layout (per 32 weights a float16 scale d, a float16 minimum m and 16
  bytes of nibbles, weights 0..15 in the low nibbles and 16..31 in the high ones; w = d * nibble + m): Q4_0 is
  d (nibble - 8), so m = -8 d, exact in float16; Q4_1 is the layout itself. So does IQ3_S, whose every weight is
  its block's scale b times an odd number -15..15 (the grid's 1, 3, .. 15 with a sign): nibble (v + 15) / 2,
  d = 2 b and m = -15 b in float16 (b = d (1 + 2 s) has up to 16 significant bits: each rounded to float16's 11
  where it has more, a weight at most 45 / 2048 b off, 1 % of the step 2 b between two levels). That layout has
  VNNI and AVX2 tiles over a copy packed at load.
- Q8_0, the k-quants (Q2_K to Q6_K), IQ4_XS, Q5_0, Q5_1, IQ4_NL, F16 and BF16 stay in the file's own bytes
  (BlockWeight): the kernels read them as they are (csrc/block_form.h), no copy beside them (the k-quants, IQ4_XS,
  Q5_0, Q5_1 and IQ4_NL are packed at load for the tiles instead). The symmetric blocks of 32 the plan names
  (``ExecutionPlan.int8_layout``: wherever the kernels take int8 inputs, Q8_0) map onto quant.py's int8 layout
  instead (``int8_weight``, which takes Q5_0 and IQ4_NL too: each weight's code as an int8, Q5_0's less 16 and
  IQ4_NL's looked up, each block's float16 scale as a float32; exact). So do the i-quants that scale blocks of 16
  (IQ_INT8_TYPES: IQ2_XS, IQ2_S, IQ1_M, ``_whole_blocks``): a block of 32 whose two scales give whole numbers
  that fit an int8 exactly, another rounded once as Q8_0 rounds (at most 1/254 of its largest weight off).
- IQ3_XXS, IQ2_XXS and IQ1_S, whose blocks of 32 are a scale of their own times one of at most 16 levels (their
  grid's values with a sign: 16, 6 and 6 of them), go into IQ4_NL's nibbles over their type's levels and a float32
  scale (``level_weight``, kernels.LEVEL_TYPES: type numbers of their own, the kernels' IQ4_NL tiles over another
  table; exact).
- F32 and any other type are served as float32, dequantized by gguf-py; a type gguf-py cannot read stops the
  start with its name.
- A token embedding that is not also the output head, whatever its type, stays in the mapped file (``file_rows``):
  its rows are dequantized when looked up.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from ..kernels import LEVEL_BLOCK
from ..kernels.quant import LEVEL_TYPES, BlockWeight, FileRows, Int4Weight, Int8Weight
from .gguf_meta import BLOCK_TYPES, INT4_TYPES, IQ_INT8_TYPES  # taken as they are, or in the int8 layout


def _rows(t) -> tuple[int, int, np.ndarray]:
    """(rows, inputs per row, the raw bytes as [rows, bytes per row])."""
    n, k = int(t.shape[1]), int(t.shape[0])
    return n, k, np.asarray(t.data).view(np.uint8).reshape(n, -1)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def int4_weight(t) -> Int4Weight:
    """A Q4_0, Q4_1 or IQ3_S tensor [N, K] as an Int4Weight."""
    n, k, raw = _rows(t)
    kind = t.tensor_type.name
    if kind == "IQ3_S":
        return _iq3s_int4(raw, n, k)
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        blocks = raw.reshape(n, k // 32, size)
        d = _f16(blocks[..., 0:2])
        m = (d * np.float16(-8)) if kind == "Q4_0" else _f16(blocks[..., 2:4])
        q = blocks[..., size - 16 :]  # the layout's own nibble order
    else:
        raise ValueError(f"{kind} is not a 4-bit block type taken as it is")
    return Int4Weight(
        torch.from_numpy(np.ascontiguousarray(q).reshape(n, k // 2)),
        torch.from_numpy(np.ascontiguousarray(d).reshape(n, k // 32)),
        torch.from_numpy(np.ascontiguousarray(m).reshape(n, k // 32)),
    )


def _dequantized(raw: np.ndarray, kind: str, k: int):
    """gguf-py's float32 weights of rows [N, bytes] of a ``kind`` tensor, DEQUANTIZE_WEIGHTS at a time: (first row,
    weights [rows, K]) for each piece, not the whole tensor's temporaries (and gguf-py's own) at once."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    step = max(1, DEQUANTIZE_WEIGHTS // k)
    for a in range(0, raw.shape[0], step):
        w = dequantize(raw[a : a + step], GGMLQuantizationType[kind])
        yield a, np.asarray(w, dtype=np.float32).reshape(-1, k)


def _iq3s_int4(raw: np.ndarray, n: int, k: int) -> Int4Weight:
    """An IQ3_S tensor's rows ([N, bytes]) in the int4 layout: each block's weights over its scale b (as gguf-py
    computes it) are odd numbers v in -15..15, whose nibbles (v + 15) / 2 give w = 2 b nibble - 15 b (a few MB of
    gguf-py's float32 weights at a time)."""
    b = _iq_scales("IQ3_S", raw)
    q = np.empty((n, k // 32, 16), dtype=np.uint8)
    safe = np.where(b == 0, 1, b)[..., None]
    for a, w in _dequantized(raw, "IQ3_S", k):
        nib = ((np.rint(w.reshape(-1, k // 32, 32) / safe[a : a + len(w)]).astype(np.int16) + 15) >> 1).astype(np.uint8)
        q[a : a + len(w)] = nib[..., :16] | (nib[..., 16:] << 4)
    return Int4Weight(
        torch.from_numpy(q.reshape(n, k // 2)),
        torch.from_numpy((2 * b).astype(np.float16)),
        torch.from_numpy((-15 * b).astype(np.float16)),
    )


INT8_TYPES = {"Q8_0", "Q5_0", "IQ4_NL"} | IQ_INT8_TYPES  # blocks of 32: w = d * code, code an int8
# the weights gguf-py dequantizes at a time into int8_weight's codes: the temporaries of a whole large tensor took
# 2 GB beside the weights (Qwen2.5 1.5B's IQ3_S token embedding, 151,936 x 1,536)
DEQUANTIZE_WEIGHTS = 1 << 22


def _iq_scales(kind: str, raw: np.ndarray) -> np.ndarray:
    """The scale of each block of 32 [N, K / 32] of a LEVEL_TYPES or IQ3_S tensor's super-blocks of 256 ([N, bytes]),
    computed as gguf-py's dequantization computes it (so that each weight over it is its whole number exactly)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    n = raw.shape[0]
    sb = raw.reshape(n, -1, GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1])  # super-blocks of 256 weights
    d = _f16(sb[..., 0:2]).astype(np.float32)[..., None]
    if kind in ("IQ2_XXS", "IQ3_XXS"):  # each block's 4-bit scale in the top bits of its uint32 of signs
        words = np.ascontiguousarray(sb[..., 2:] if kind == "IQ2_XXS" else sb[..., 66:]).view(np.uint32)
        ls = (words.reshape(n, -1, 8, 2)[..., 1] if kind == "IQ2_XXS" else words) >> 28
        scale = d * (np.float32(0.5) + ls.astype(np.float32)) * np.float32(0.25 if kind == "IQ2_XXS" else 0.5)
    elif kind == "IQ3_S":  # d, 64 bytes of grid indices, 8 of their high bits, 32 of signs, 4 of 4-bit scales
        nibbles = sb[..., 106:110, None] >> np.array([0, 4], dtype=np.uint8)
        scale = d * (1 + 2 * (nibbles & 0x0F).reshape(n, -1, 8)).astype(np.float32)
    else:  # IQ1_S: d, 32 bytes of grid indices, per block a uint16 (3-bit scale, the sign of its 1/8 shift)
        qh = np.ascontiguousarray(sb[..., 34:50]).view(np.uint16)
        scale = d * (2 * ((qh >> 12) & 7) + 1).astype(np.float32) / np.float32(8)  # (a code: 8 x grid +- 1)
    return np.ascontiguousarray(scale.reshape(n, -1), dtype=np.float32)


def _units(kind: str, raw: np.ndarray) -> np.ndarray:
    """Each super-block's unit [N, K / 256] of an IQ_INT8_TYPES tensor ([N, bytes]): its d / 8, of which every
    weight is a whole number (IQ2_XS and IQ2_S: d (2 s + 1) / 8 times a grid value; IQ1_M: d (2 s + 1) (8 grid +- 1)
    / 8, its float16 d in the top 4 bits of its 4 scale words)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    n = raw.shape[0]
    sb = raw.reshape(n, -1, GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1])
    if kind == "IQ1_M":
        words = np.ascontiguousarray(sb[..., 48:56]).view(np.uint16) & np.uint16(0xF000)
        d = words >> np.array([12, 8, 4, 0], dtype=np.uint16)
        d = (d[..., 0] | d[..., 1] | d[..., 2] | d[..., 3]).view(np.float16)
    else:
        d = _f16(sb[..., 0:2])
    return d.astype(np.float32) / np.float32(8)


def _whole_blocks(w: np.ndarray, units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Int8 codes [R, K] and scales [R, K / 32] of weights [R, K] that are whole numbers of their super-block's unit
    ([R, K / 256]). A block of 32 whose whole numbers over their greatest common divisor fit an int8 keeps them (its
    scale the unit times that divisor: exact); another, whose halves' scales differ too much for that, is rounded to
    127 steps of its largest weight, as llama.cpp's Q8_0 rounds (each weight at most 1/254 of the largest off)."""
    r, k = w.shape
    unit = np.repeat(units, 8, axis=1)[..., None]  # [R, K / 32, 1]
    whole = np.rint(w.reshape(r, -1, 32) / np.where(unit == 0, 1, unit)).astype(np.int32)
    divisor = np.maximum(np.gcd.reduce(whole, axis=-1, keepdims=True), 1)
    top = np.abs(whole).max(-1, keepdims=True)
    exact = top <= 127 * divisor
    q = np.where(exact, whole // divisor, np.rint(whole * (127 / np.maximum(top, 1))))
    scale = np.where(exact, unit * divisor, unit * top / 127)
    return q.astype(np.int8).reshape(r, k), scale[..., 0].astype(np.float32)


def int8_weight(t) -> Int8Weight:
    """A Q8_0, Q5_0, IQ4_NL or IQ_INT8_TYPES tensor [N, K] as an Int8Weight of groups of 32: each weight's code
    (Q8_0's as it is, Q5_0's 5-bit value less 16, IQ4_NL's level, an i-quant's whole number of its block's scale)
    contiguous and 32-byte aligned per block, the scales apart; the same numbers (each block is d * code, d its
    leading float16, or the i-quant block's own scale), but for the i-quant blocks whose two scales do not fit one
    int8 block (``_whole_blocks``: rounded once)."""
    n, k, raw = _rows(t)
    kind = t.tensor_type.name
    if kind not in INT8_TYPES:
        raise ValueError(f"{kind} is not a block type of 32 int8 codes ({', '.join(sorted(INT8_TYPES))})")
    if kind in IQ_INT8_TYPES:
        d = np.empty((n, k // 32), dtype=np.float32)  # each block's own: filled with the codes
    else:
        d = _f16(raw.reshape(n, k // 32, -1)[..., 0:2]).astype(np.float32)
    if kind == "Q8_0":
        q = np.ascontiguousarray(raw.reshape(n, k // 32, -1)[..., 2:]).view(np.int8).reshape(n, k)
    else:  # gguf-py's weights over their block's scale: whole numbers, exactly (a small integer times d)
        q = np.empty((n, k), dtype=np.int8)
        for a, w in _dequantized(raw, kind, k):
            rows = slice(a, a + len(w))
            if kind in IQ_INT8_TYPES:
                q[rows], d[rows] = _whole_blocks(w, _units(kind, raw[rows]))
            else:
                safe = np.where(d[rows] == 0, 1, d[rows])[..., None]
                q[rows] = np.rint(w.reshape(-1, k // 32, 32) / safe).reshape(-1, k)
    return Int8Weight(torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(d).reshape(n, k // 32)))


def level_weight(t) -> BlockWeight:
    """An IQ3_XXS, IQ2_XXS or IQ1_S tensor [N, K] in IQ4_NL's nibbles over its type's levels (kernels.LEVEL_TYPES):
    each block's weights over its scale b (as gguf-py computes it) are its grid's values with their signs, looked up
    as nibbles; b a float32 before them (exact: a float16 times a factor of 4 bits). A few MB of gguf-py's float32
    weights at a time."""
    n, k, raw = _rows(t)
    kind = t.tensor_type.name
    number, levels = LEVEL_TYPES[kind]
    table = np.asarray(levels, dtype=np.float32)
    b = _iq_scales(kind, raw)
    safe = np.where(b == 0, 1, b)[..., None]
    out = np.empty((n, k // 32, LEVEL_BLOCK), dtype=np.uint8)
    out[..., :4] = b.astype(np.float32)[..., None].view(np.uint8)
    for a, w in _dequantized(raw, kind, k):
        v = np.rint(w.reshape(-1, k // 32, 32) / safe[a : a + len(w)])
        idx = np.searchsorted(table, v).clip(0, len(levels) - 1).astype(np.uint8)
        if not np.array_equal(table[idx], v):
            raise ValueError(f"{kind}: a weight off its type's levels")
        out[a : a + len(w), :, 4:] = idx[..., :16] | (idx[..., 16:] << 4)
    return BlockWeight(torch.from_numpy(out.reshape(n, -1)), number, k)


def block_weight(t) -> BlockWeight:
    """A tensor [N, K] of a BLOCK_TYPES type in its own bytes, row by row."""
    n, k, raw = _rows(t)
    return BlockWeight(torch.from_numpy(raw.copy()), int(t.tensor_type), k)  # a copy: the file is mapped read-only


def file_rows(t) -> FileRows:
    """A tensor [N, K] of any type gguf-py reads, left in the mapped file for row lookups (quant.FileRows)."""
    n, k, raw = _rows(t)
    return FileRows(raw, int(t.tensor_type), k, t.tensor_type.name in BLOCK_TYPES)


def packed(t, int8_layout: Collection[str] = ()) -> Int4Weight | Int8Weight | BlockWeight | None:
    """The tensor's blocks as the kernels take them, or None when its type is served as float32; ``int8_layout``: the
    types (of INT8_TYPES) served in the int8 layout (``int8_weight``)."""
    kind = t.tensor_type.name
    if kind in LEVEL_TYPES:
        return level_weight(t)
    if kind in INT8_TYPES and kind in int8_layout:
        return int8_weight(t)
    if kind in INT4_TYPES:
        return int4_weight(t)
    if kind in BLOCK_TYPES:
        return block_weight(t)
    return None
