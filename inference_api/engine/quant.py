"""Weight-only quantized linears: 8-bit and 4-bit weight groups, float32 activations and accumulation.

Layouts follow GGUF's blocks, so a GGUF model keeps the weights it was quantized to:
- int8: ``q`` [N, K] int8 and one float scale per group of G inputs (G = 32 as in Q8_0, or K: per
  output channel); w = q * s.
- int4: ``q`` [N, K/2] uint8 in blocks of 32 weights (low nibbles are weights 0..15, high nibbles
  16..31, as in Q4_1) with a float16 scale d and minimum m per block; w = d * nibble + m.

The kernels (``csrc/woq.cpp``) compute float32 ``F.linear`` on the dequantized weight, up to summation
order, while reading a quarter or an eighth of the float32 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("none", "int8", "int4")


@dataclass
class Int8Weight:
    q: torch.Tensor  # [N, K] int8
    s: torch.Tensor  # [N, K / G] float32

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.view(n, self.s.shape[1], -1).float() * self.s[..., None]).view(n, k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (an embedding lookup)."""
        q, s = self.q[ids], self.s[ids]
        return (q.view(*q.shape[:-1], s.shape[-1], -1).float() * s[..., None]).flatten(-2)


@dataclass
class Int4Weight:
    q: torch.Tensor  # [N, K / 2] uint8
    d: torch.Tensor  # [N, K / 32] float16
    m: torch.Tensor  # [N, K / 32] float16

    def dequantize(self) -> torch.Tensor:
        return self.rows(slice(None))

    def rows(self, ids) -> torch.Tensor:
        """Dequantized rows (an embedding lookup; a slice: all of them)."""
        q = self.q[ids]
        q = q.view(*q.shape[:-1], -1, 16)
        nib = torch.cat([q & 15, q >> 4], dim=-1).float()  # [..., K/32, 32]
        return (nib * self.d[ids].float()[..., None] + self.m[ids].float()[..., None]).flatten(-2)


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
    """The 8-bit weight packed for the VNNI tiles: [N / 16, K / 32, 8, 16, 4] int8 (16 rows x 4 inputs per 64
    bytes), and per block of 32 its scale and 128 times the sum of its weights [N / 16, K / 32, 2, 16] float
    (the tiles add 128 to the inputs, and take it back through that sum)."""
    n, k = w.q.shape
    blocks = k // 32
    q = w.q.view(n // 16, 16, blocks, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    scale = w.s.repeat_interleave(blocks // w.s.shape[1], dim=1)
    corr = 128 * w.q.view(n, blocks, 32).sum(-1, dtype=torch.int32).float()
    by_group = [t.view(n // 16, 16, blocks).transpose(1, 2) for t in (scale, corr)]
    return q, torch.stack(by_group, dim=2).contiguous()


def can_vnni(w: Int8Weight | Int4Weight) -> bool:
    """Whether the VNNI tiles take this weight: rows in groups of 16, blocks of 32 inputs under each scale."""
    n, k = w.q.shape[0], w.q.shape[1] * (2 if isinstance(w, Int4Weight) else 1)
    return n % 16 == 0 and k % 32 == 0 and (isinstance(w, Int4Weight) or (k // w.s.shape[1]) % 32 == 0)


def can_quantize(w: torch.Tensor, mode: str) -> bool:
    return mode == "int8" or (mode == "int4" and w.shape[1] % 32 == 0)


class QuantLinear:
    """A linear layer over an Int8Weight or Int4Weight, through the compiled kernels. int8_inputs: the inputs
    of up to 16 rows are rounded to int8 per block of 32 (127 steps of the block's own scale, llama.cpp's
    Q8 activations) and the kernel multiplies integers, within half a step of each input
    (docs/performance.md). More rows stay float32."""

    def __init__(self, weight: Int8Weight | Int4Weight, bias: torch.Tensor | None, kernels, int8_inputs: bool = False):
        self.weight, self.bias, self.kernels, self.int8_inputs = weight, bias, kernels, int8_inputs
        self.vnni = (None, None)  # several rows' int8 inputs go to the VNNI tiles where the kernels have them
        if int8_inputs and kernels.vnni() and can_vnni(weight):
            self.vnni = vnni_int4(weight) if isinstance(weight, Int4Weight) else vnni_int8(weight)

    def parts(self) -> tuple:
        """The layer as the kernels' Decoder takes it: (q, scales, minimums or None, bias, int8_inputs, VNNI
        weights or None, their scales or None)."""
        w = self.weight
        scales, mins = (w.s, None) if isinstance(w, Int8Weight) else (w.d, w.m)
        return w.q, scales, mins, self.bias, self.int8_inputs, *self.vnni

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(w, Int8Weight):
            return self.kernels.linear_int8(x, w.q, w.s, self.bias, self.int8_inputs, *self.vnni)
        return self.kernels.linear_int4(x, w.q, w.d, w.m, self.bias, self.int8_inputs, *self.vnni)
