"""The linear layers a model is served with, picked once at start-up.

- CPU, float32 weights: oneDNN with each weight reordered once into its blocked layout (faster than
  torch's default sgemm path for decode shapes; the math is the same up to summation order).
- CPU, ``--quantize int8|int4``: the weight-only kernels of quant.py (float32 math on 8-bit or 4-bit
  weights): for one row, the decode step of one stream, bound by the bytes of weight it reads; for several
  rows, chunks of the weight dequantized in cache and multiplied in register tiles, faster than oneDNN on a
  float32 copy of the weights without holding one (measured on the 2-core machines: docs/backend.md). With
  AVX512-VNNI and --dtype auto, every row count runs on the kernels' integer tiles over weights packed once
  (quant.py). On a CPU that multiplies bfloat16 but has no AVX512-VNNI, several rows run on a bfloat16 oneDNN
  copy instead (plan.py decides), for half a float32 copy's memory. Without a compiler for the kernels, oneDNN alone.
- CUDA, 4-bit weights (a GGUF's Q4 blocks, ``--quantize int4``): torch's tinygemm kernel
  (``_weight_int4pack_mm``, bfloat16 activations, groups of 32), which reads the 4-bit weights; a GPU or torch
  without it (before Ampere) gets the dequantized weights instead.
- Other devices and 8-bit weights: F.linear in the model's dtype, on the (dequantized) weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.quant import QUANTIZED, Int4Weight, Int8Weight, QuantLinear, can_quantize, quantize_int4, quantize_int8

log = logging.getLogger(__name__)


class DenseLinear:
    """F.linear on a dense weight (CUDA, or a CPU without oneDNN)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def row_bucket(rows: int) -> int:
    """The row count a oneDNN call is padded to: 1, 8, 16, 32, then multiples of 64. oneDNN caches a
    primitive (about 0.75 MB here) for every input shape it meets, up to 1024 of them; without buckets,
    the varying batch and prompt-chunk sizes of a long-running server grew the engine by hundreds of MB."""
    if rows <= 1:
        return rows
    if rows <= 32:
        return 8 if rows <= 8 else 16 if rows <= 16 else 32
    return -(-rows // 64) * 64


class OneDNNLinear:
    """A CPU linear whose weight was reordered once into oneDNN's blocked layout: float32, or bfloat16
    (inputs rounded to bfloat16, float32 accumulation, the sums rounded to bfloat16 and handed back as
    float32) on CPUs that multiply bfloat16. Inputs are padded to a few row counts (row_bucket)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), None)
        self.bias, self.dtype = bias, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(self.dtype)
        rows, padded = x2.shape[0], row_bucket(x2.shape[0])
        if padded != rows:
            x2 = F.pad(x2, (0, 0, 0, padded - rows))
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, None, "none", [], "")[:rows].float()
        if self.bias is not None:  # added in float32, after the cast back
            y = y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


class Int4CudaLinear:
    """A 4-bit weight (blocks of 32, w = d * nibble + m) through torch's tinygemm CUDA kernel. tinygemm
    dequantizes (nibble - 8) * scale + zero, so Q4_1's blocks map onto it exactly: scale d, zero m + 8 d
    (both held in bfloat16, as the kernel takes them)."""

    GROUP, INNER_K_TILES = 32, 2

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, device: torch.device):
        n = weight.q.shape[0]
        q = weight.q.view(n, -1, 16)
        nibbles = torch.cat([q & 15, q >> 4], dim=-1).view(n, -1)  # [N, K] in 0..15
        pairs = (nibbles[:, ::2] << 4 | nibbles[:, 1::2]).to(torch.uint8)  # element 2i high, 2i + 1 low
        self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs.to(device), self.INNER_K_TILES)
        d, m = weight.d.float(), weight.m.float()
        self.scales_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().to(device, torch.bfloat16)
        self.bias, self.out_features = bias, n

    @classmethod
    def fits(cls, weight: Int4Weight, device: torch.device) -> bool:
        """Whether the kernel takes this weight here: an Ampere or later GPU, K a multiple of its k-tiles."""
        n, k = weight.q.shape[0], weight.q.shape[1] * 2
        return (
            device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (8, 0)
            and hasattr(torch.ops.aten, "_weight_int4pack_mm")
            and n % 8 == 0
            and k % (cls.INNER_K_TILES * 16) == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.GROUP, self.scales_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class SplitLinear:
    """The quantized kernel for one row, oneDNN on a bfloat16 copy of the weight for more: picked per call."""

    def __init__(self, quantized: QuantLinear, dense: OneDNNLinear):
        self.quantized, self.dense = quantized, dense
        self.weight = quantized.weight  # the quantized form: embedding lookups of a tied head read its rows
        self.rows = quantized.rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized(x) if x.numel() == x.shape[-1] else self.dense(x)


def quantize(weight: torch.Tensor, mode: str, group: int | None = None) -> Int8Weight | Int4Weight | None:
    if mode == "none" or not can_quantize(weight, mode):
        return None
    return quantize_int8(weight, group) if mode == "int8" else quantize_int4(weight)


def linear_factory(
    device: torch.device,
    dtype: torch.dtype,
    mode: str,
    kernels,
    batch_dtype: torch.dtype | None = None,
    int8_inputs: bool = False,
) -> Callable:
    """make_linear(weight [N, K], bias) -> a callable layer, for this device, dtype and quantization;
    batch_dtype: the dtype of a oneDNN copy that quantized layers run several rows on (None: no copy, the
    kernels run them); int8_inputs: the kernels round every row's inputs to int8 blocks (QuantLinear)."""
    onednn = device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()

    def make_linear(
        weight, bias: torch.Tensor | None, group: int | None = None, as_mode: str | None = None, lookups: bool = False
    ):
        """weight: a float weight, quantized here as as_mode (or the plan's mode) says, or a GGUF's own blocks
        (gguf_blocks), kept as they are; with --quantize none both are served dense. lookups: its rows are read as
        an embedding too (a tied head: QuantLinear keeps its codes)."""
        bias = None if bias is None else bias.detach().to(device=device, dtype=dtype).clone()
        if isinstance(weight, QUANTIZED):
            packed = weight if mode != "none" else None
            weight = weight if packed is not None else weight.dequantize(kernels)
        else:
            packed = quantize(weight, (as_mode or mode) if mode != "none" else "none", group)
        if packed is not None and kernels is not None and device.type == "cpu" and dtype == torch.float32:
            if onednn and batch_dtype is not None:
                dense = OneDNNLinear(packed.dequantize(kernels), bias, batch_dtype)
                return SplitLinear(QuantLinear(packed, bias, kernels, int8_inputs, lookups), dense)
            return QuantLinear(packed, bias, kernels, int8_inputs, lookups)
        if isinstance(packed, Int4Weight) and dtype == torch.bfloat16 and Int4CudaLinear.fits(packed, device):
            return Int4CudaLinear(packed, bias, device)
        if packed is not None:
            weight = packed.dequantize(kernels if device.type == "cpu" else None)
        if onednn:
            return OneDNNLinear(weight, bias)
        return DenseLinear(weight.detach().to(device=device, dtype=dtype).clone(), bias)

    return make_linear


class LinearModule(nn.Module):
    """An nn.Module around one of the layers above, to stand in for nn.Linear inside transformers' models."""

    def __init__(self, layer, in_features: int, out_features: int):
        super().__init__()
        self.layer, self.in_features, self.out_features = layer, in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {type(self.layer).__name__}"


def use_linears(model: nn.Module, make_linear: Callable) -> int:
    """Replace every nn.Linear of a transformers model by a layer of make_linear; return how many. The
    tensors left dense are copied, so the memory-mapped weights file (and the replaced weights) go."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(
            parent, name, LinearModule(make_linear(child.weight, child.bias), child.in_features, child.out_features)
        )
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    return len(targets)
