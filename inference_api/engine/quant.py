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
        n = self.q.shape[0]
        q = self.q.view(n, -1, 16)
        nib = torch.cat([q & 15, q >> 4], dim=-1).float()  # [N, K/32, 32]
        return (nib * self.d.float()[..., None] + self.m.float()[..., None]).view(n, -1)


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


def can_quantize(w: torch.Tensor, mode: str) -> bool:
    return mode == "int8" or (mode == "int4" and w.shape[1] % 32 == 0)


class QuantLinear:
    """A linear layer over an Int8Weight or Int4Weight, through the compiled kernels. int8_inputs: the inputs
    of up to 16 rows are rounded to int8 per block of 32 (127 steps of the block's own scale, llama.cpp's
    Q8 activations) and the kernel multiplies integers, within half a step of each input
    (docs/performance.md). More rows stay float32."""

    def __init__(self, weight: Int8Weight | Int4Weight, bias: torch.Tensor | None, kernels, int8_inputs: bool = False):
        self.weight, self.bias, self.kernels, self.int8_inputs = weight, bias, kernels, int8_inputs

    def parts(self) -> tuple:
        """The layer as the kernels' Decoder takes it: (q, scales, minimums or None, bias, int8_inputs)."""
        w = self.weight
        scales, mins = (w.s, None) if isinstance(w, Int8Weight) else (w.d, w.m)
        return w.q, scales, mins, self.bias, self.int8_inputs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(w, Int8Weight):
            return self.kernels.linear_int8(x, w.q, w.s, self.bias, self.int8_inputs)
        return self.kernels.linear_int4(x, w.q, w.d, w.m, self.bias, self.int8_inputs)
