"""Weight-only quantized linears: float32 activations and accumulation over weights in one of three forms.

- int8: ``q`` [N, K] int8 and one float scale per group of G inputs (G = 32 as in Q8_0, or K: per
  output channel); w = q * s.
- int4: ``q`` [N, K/2] uint8 in blocks of 32 weights (low nibbles are weights 0..15, high nibbles
  16..31, as in Q4_1) with a float16 scale d and minimum m per block; w = d * nibble + m.
- blocks: a GGUF tensor's own bytes, row by row, of any type the kernels serve (Q4_K, Q5_0, Q6_K, IQ4_NL, F16,
  ...: ``kernels.gguf_types()``); nothing is rounded again. Rows of different types stacked in one layer (a
  Q4_K_M file's q, k and v) are pieces of one layer (``StackedWeight``).

The kernels (``csrc/``: linear.cpp's one ladder over int_forms.h and block_form.h) compute float32 ``F.linear``
on the dequantized weight, up to summation order, while reading the quantized bytes.
"""

from __future__ import annotations

import dataclasses
import mmap
from dataclasses import dataclass, fields

import numpy as np
import torch

from . import LEVEL_BLOCK, LEVEL_TYPES

MODES = ("none", "int8", "int4")


@dataclass
class Int8Weight:
    q: torch.Tensor  # [N, K] int8
    s: torch.Tensor  # [N, K / G] float32

    def dequantize(self, kernels=None) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.view(n, self.s.shape[1], -1).float() * self.s[..., None]).view(n, k)

    def rows(self, ids: torch.Tensor, kernels=None) -> torch.Tensor:
        """Dequantized rows (an embedding lookup)."""
        q, s = self.q[ids], self.s[ids]
        return (q.view(*q.shape[:-1], s.shape[-1], -1).float() * s[..., None]).flatten(-2)

    def map_rows(self, fn) -> Int8Weight:
        return Int8Weight(fn(self.q), fn(self.s))


@dataclass
class Int4Weight:
    q: torch.Tensor  # [N, K / 2] uint8
    d: torch.Tensor  # [N, K / 32] float16
    m: torch.Tensor  # [N, K / 32] float16

    def dequantize(self, kernels=None) -> torch.Tensor:
        return self.rows(slice(None))

    def rows(self, ids, kernels=None) -> torch.Tensor:
        """Dequantized rows (an embedding lookup; a slice: all of them)."""
        q = self.q[ids]
        q = q.view(*q.shape[:-1], -1, 16)
        nib = torch.cat([q & 15, q >> 4], dim=-1).float()  # [..., K/32, 32]
        return (nib * self.d[ids].float()[..., None] + self.m[ids].float()[..., None]).flatten(-2)

    def map_rows(self, fn) -> Int4Weight:
        return Int4Weight(fn(self.q), fn(self.d), fn(self.m))


def block_type(ggml_type: int) -> tuple[str, int, int]:
    """A served block type's name, weights and bytes a block: ggml's, or a level type's (its i-quant's name,
    LEVEL_BLOCK bytes a block of 32)."""
    for name, (number, _) in LEVEL_TYPES.items():
        if number == ggml_type:
            return name, 32, LEVEL_BLOCK
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType(ggml_type)
    return kind.name, *GGML_QUANT_SIZES[kind]


def level_dequantize(raw: np.ndarray, levels: tuple[int, ...]) -> np.ndarray:
    """Float32 weights [N, K] of rows [N, bytes] in a level type's blocks (a float32 scale, IQ4_NL's nibbles) over
    these levels."""
    blocks = raw.reshape(raw.shape[0], -1, LEVEL_BLOCK)
    d = np.ascontiguousarray(blocks[..., :4]).view(np.float32)  # [N, K / 32, 1]
    nibbles = np.concatenate([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], axis=-1)
    table = np.zeros(16, dtype=np.float32)
    table[: len(levels)] = levels
    return (table[nibbles] * d).reshape(raw.shape[0], -1)


@dataclass
class BlockWeight:
    """A GGUF tensor [N, K] in its own blocks: ``raw`` [N, bytes per row] uint8, ``ggml_type`` its type's number (or
    a level type's, LEVEL_TYPES)."""

    raw: torch.Tensor
    ggml_type: int
    k: int

    @property
    def type_name(self) -> str:
        return block_type(self.ggml_type)[0]

    def dequantize(self, kernels=None) -> torch.Tensor:
        return self.rows(slice(None), kernels)

    def rows(self, ids, kernels=None) -> torch.Tensor:
        """Dequantized rows (an embedding lookup; a slice: all of them): the kernels' own dequantization where
        given, else gguf-py's (the same numbers)."""
        raw = self.raw[ids]
        flat = raw.reshape(-1, raw.shape[-1]).contiguous()
        if kernels is not None:
            out = kernels.dequantize_gguf(flat, self.ggml_type)
        elif (levels := next((lv for n, lv in LEVEL_TYPES.values() if n == self.ggml_type), None)) is not None:
            out = torch.from_numpy(level_dequantize(flat.numpy(), levels))
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            out = torch.from_numpy(
                np.asarray(dequantize(flat.numpy(), GGMLQuantizationType(self.ggml_type)), dtype=np.float32).reshape(
                    flat.shape[0], self.k
                )
            )
        return out.view(*raw.shape[:-1], self.k)

    def map_rows(self, fn) -> BlockWeight:
        return BlockWeight(fn(self.raw), self.ggml_type, self.k)


@dataclass
class FileRows:
    """A GGUF tensor [N, K] left in the file's read-only memory map, only for lookups (an untied token embedding on
    the CPU): rows copied out and dequantized when read, so the table is never resident beside the weights (Llama 3
    8B's Q4_K one: 0.3 GB; an IQ3_S one, 0.1 GB in the file, would take 0.15 GB in the int4 layout); only the pages
    of rows read are, and those are the file's own (the system's page cache, shared with other readers).
    ``served``: the kernels dequantize the type (else gguf-py does)."""

    raw: np.ndarray  # [N, bytes per row] uint8, a view of the file
    ggml_type: int
    k: int
    served: bool

    def rows(self, ids, kernels=None) -> torch.Tensor:
        """Dequantized rows (a slice: all of them)."""
        if isinstance(ids, torch.Tensor):
            shape = ids.shape
            ids = ids.reshape(-1).cpu().numpy()
        else:
            shape = None
        part = self.raw[ids]  # an index array copies the rows; a slice is a view of the read-only map: copied
        flat = BlockWeight(torch.from_numpy(part if part.flags.writeable else part.copy()), self.ggml_type, self.k)
        out = flat.rows(slice(None), kernels if self.served else None)
        return out if shape is None else out.view(*shape, self.k)

    def dequantize(self, kernels=None) -> torch.Tensor:
        return self.rows(slice(None), kernels)


@dataclass
class StackedWeight:
    """Weights of different forms or types stacked along their rows: one layer's pieces (a fused QKV whose v is
    Q6_K while q and k are Q4_K), each served in its own form."""

    pieces: list

    def dequantize(self, kernels=None) -> torch.Tensor:
        return torch.cat([p.dequantize(kernels) for p in self.pieces])

    def rows(self, ids, kernels=None) -> torch.Tensor:
        return self.dequantize(kernels)[ids]


QUANTIZED = (Int8Weight, Int4Weight, BlockWeight, StackedWeight)  # the forms a linear takes as they are


def stack(parts: list) -> Int8Weight | Int4Weight | BlockWeight | StackedWeight:
    """Weights stacked along their rows: one weight where every part has one form (and type), else the pieces."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if (
        all(type(p) is type(first) for p in parts)
        and not isinstance(first, StackedWeight)
        and (not isinstance(first, BlockWeight) or all(p.ggml_type == first.ggml_type for p in parts))
        and (not isinstance(first, Int8Weight) or len({p.s.shape[1] for p in parts}) == 1)
    ):
        if isinstance(first, BlockWeight):
            return BlockWeight(torch.cat([p.raw for p in parts]), first.ggml_type, first.k)
        return type(first)(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(first)))
    return StackedWeight([q for p in parts for q in (p.pieces if isinstance(p, StackedWeight) else [p])])


def quantize_int8(w: torch.Tensor, group: int | None = None) -> Int8Weight:
    """Symmetric 8-bit groups of ``group`` inputs (None: one scale per output channel)."""
    w = w.detach().float()
    n, k = w.shape
    group = k if group is None or k % group else group
    g = w.view(n, k // group, group)
    s = g.abs().amax(-1) / 127
    q = torch.where(s[..., None] > 0, g / s[..., None].clamp(min=torch.finfo(torch.float32).tiny), 0)
    return Int8Weight(q.round().clamp(-127, 127).to(torch.int8).view(n, k).contiguous(), s.contiguous())


def quantize_int4(w: torch.Tensor) -> Int4Weight:
    """Asymmetric 4-bit blocks of 32 (the block minimum and (max - min) / 15 as in Q4_1, both float16). A
    weight that came from a Q4_1 block gets its original nibbles, scale and minimum back."""
    w = w.detach().float()
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()
    step = d.float()[..., None]
    nib = torch.where(step > 0, (g - m.float()[..., None]) / step.clamp(min=torch.finfo(torch.float16).tiny), 0)
    nib = nib.round().clamp(0, 15).to(torch.uint8)
    q = nib[..., :16] | (nib[..., 16:] << 4)
    return Int4Weight(q.reshape(n, k // 2).contiguous(), d.contiguous(), m.contiguous())


def vnni_int4(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit weight packed for the kernels' VNNI tiles: bytes [N / 16, K / 32, 4, 16, 4], where byte j of
    step a of a block holds weights 4a + j and 16 + 4a + j of one of 16 rows (Q4_1's own bytes, reordered),
    and each block's scale and minimum [N / 16, K / 32, 2, 16] in float16."""
    n, blocks = w.d.shape
    q = w.q.view(n // 16, 16, blocks, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    by_group = [t.view(n // 16, 16, blocks).transpose(1, 2) for t in (w.d, w.m)]
    return q, torch.stack(by_group, dim=2).contiguous()


def vnni_int8(w: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit weight packed for the VNNI tiles: [N / 16, K / 32, 8, 16, 4] bytes (16 rows x 4 inputs per 64
    bytes), each weight plus 128 (the tiles' unsigned side; they take the 128 back through the inputs' sums), and
    per block of 32 its scale [N / 16, K / 32, 16]: float16 where every scale is a float16 value (a GGUF's Q8_0 and
    IQ4_NL: a block reads 34 bytes, as the file's), else float."""
    n, k = w.q.shape
    blocks = k // 32
    q = w.q.view(n // 16, 16, blocks, 8, 4).permute(0, 2, 3, 1, 4).clone(memory_format=torch.contiguous_format)
    q.view(torch.uint8).bitwise_xor_(128)  # w + 128 as a byte, in place (no second copy of a large head at load)
    scale = w.s.repeat_interleave(blocks // w.s.shape[1], dim=1)
    if torch.equal(scale.half().float(), scale):
        scale = scale.half()
    return q, scale.view(n // 16, 16, blocks).transpose(1, 2).contiguous()


def can_vnni(w: Int8Weight | Int4Weight) -> bool:
    """Whether the VNNI tiles take this weight: rows in groups of 16, blocks of 32 inputs under each scale."""
    n, k = w.q.shape[0], w.q.shape[1] * (2 if isinstance(w, Int4Weight) else 1)
    return n % 16 == 0 and k % 32 == 0 and (isinstance(w, Int4Weight) or (k // w.s.shape[1]) % 32 == 0)


def can_quantize(w: torch.Tensor, mode: str) -> bool:
    return mode == "int8" or (mode == "int4" and w.shape[1] % 32 == 0)


def untouched(like: torch.Tensor) -> torch.Tensor:
    """A tensor of like's shape and dtype over an anonymous mapping of its own, whose pages nothing touches: the
    place of codes never read again (the kernels check their shape). Not torch.empty: the allocator hands out
    chunks freed a moment before, already resident."""
    count = like.numel()
    return torch.frombuffer(mmap.mmap(-1, max(1, count * like.element_size())), dtype=like.dtype, count=count).view(
        like.shape
    )


# the forms as the kernels' Decoder names them (csrc/kernels.h); a GGUF tensor's blocks go by their type's number
FORM_INT8, FORM_INT4 = -1, -2


class QuantLinear:
    """A linear layer over a weight in one of the forms above, through the compiled kernels. int8_inputs: the
    inputs are rounded to int8 per block of 32 (127 steps of the block's own scale, llama.cpp's Q8 activations)
    and the kernels multiply integers, within half a step of each input (tests/test_quality.py); the float
    types keep float32 inputs. A StackedWeight runs piece by piece, the outputs side by side."""

    def __init__(self, weight, bias: torch.Tensor | None, kernels, int8_inputs: bool = False, lookups: bool = False):
        """lookups: the weight's rows are read as an embedding too (a tied head), so its unpacked codes stay beside
        the VNNI packing; otherwise, once packed, the codes are never read again and are let go."""
        self.weight, self.bias, self.kernels, self.int8_inputs = weight, bias, kernels, int8_inputs
        self.pieces = None
        if isinstance(weight, StackedWeight):
            sizes = [p.raw.shape[0] if isinstance(p, BlockWeight) else p.q.shape[0] for p in weight.pieces]
            biases = [None] * len(sizes) if bias is None else list(bias.split(sizes))
            self.pieces = [QuantLinear(p, b, kernels, int8_inputs) for p, b in zip(weight.pieces, biases)]
            self.weight = StackedWeight([p.weight for p in self.pieces])  # the pieces' codes let go where packed
        self.vnni: tuple[torch.Tensor | None, torch.Tensor | None] = (
            None,
            None,
        )  # every row count's int8 inputs go to the tiles over this packed copy where the kernels have them
        form = FORM_INT4 if isinstance(weight, Int4Weight) else FORM_INT8
        if (
            int8_inputs
            and isinstance(weight, (Int8Weight, Int4Weight))
            and kernels.packed_tiles(form)
            and can_vnni(weight)
        ):
            self.vnni = vnni_int4(weight) if isinstance(weight, Int4Weight) else vnni_int8(weight)
            if not lookups:  # every row count now reads the packing: the codes' place is held by untouched pages
                self.weight = dataclasses.replace(weight, q=untouched(weight.q))
        elif int8_inputs and isinstance(weight, BlockWeight):
            packed = kernels.pack_k8(weight.raw, weight.ggml_type)  # k-quants, IQ4_XS, Q5_0, Q5_1, IQ4_NL; else empty
            if packed.numel():
                self.vnni = (packed, None)
                if not lookups:
                    self.weight = dataclasses.replace(weight, raw=untouched(weight.raw))

    def parts(self) -> list[tuple]:
        """The layer as the kernels' Decoder takes it, a tuple per piece: (form, q or the blocks' bytes, scales or
        None, minimums or None, bias, int8_inputs, VNNI weights or None, their scales or None)."""
        if self.pieces is not None:
            return [part for p in self.pieces for part in p.parts()]
        w = self.weight
        if isinstance(w, BlockWeight):
            return [(w.ggml_type, w.raw, None, None, self.bias, self.int8_inputs, *self.vnni)]
        if isinstance(w, Int8Weight):
            return [(FORM_INT8, w.q, w.s, None, self.bias, self.int8_inputs, *self.vnni)]
        return [(FORM_INT4, w.q, w.d, w.m, self.bias, self.int8_inputs, *self.vnni)]

    def rows(self, ids) -> torch.Tensor:
        """Rows of the dequantized weight (a tied head's embedding lookups)."""
        return self.weight.rows(ids, self.kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.pieces is not None:
            return torch.cat([p(x) for p in self.pieces], dim=-1)
        if isinstance(w, BlockWeight):
            return self.kernels.linear_gguf(x, w.raw, w.ggml_type, self.bias, self.int8_inputs, self.vnni[0])
        if isinstance(w, Int8Weight):
            return self.kernels.linear_int8(x, w.q, w.s, self.bias, self.int8_inputs, *self.vnni)
        return self.kernels.linear_int4(x, w.q, w.d, w.m, self.bias, self.int8_inputs, *self.vnni)
