"""Embedding models from a GGUF, as llama.cpp's bert graph runs them (``ENCODERS``: bert, and nomic-bert as
nomic-embed-text converts): tokens and token types (BERT also learned positions) embedded and normalized, then
per layer bidirectional attention (nomic-bert: NEOX rotary on q and k) and an MLP (BERT: GELU; nomic-bert: SwiGLU),
each added to the residual and layer-normalized after (post-norm), and the token vectors pooled as the file says
(``<arch>.pooling_type``: mean, cls, last; rank: a cross-encoder's classifier head gives one score).

The weights are read from the file by llama.cpp's tensor names: a quantized file's linears run on its own blocks
through the CPU kernels (int8 inputs, as llama.cpp rounds its activations), a float file's dense in float32; the
rest is torch's, the attention SDPA with each input's padding masked out, so an input's vector does not depend on
what else shares its batch (the kernels compute each row alone).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .compact import apply_rope

# llama.cpp's pooling types (LLAMA_POOLING_TYPE_*)
POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


@dataclass(frozen=True)
class EncoderArch:
    """One GGUF encoder family: what llama.cpp's bert graph does differently for it (src/models/bert.cpp)."""

    rope: bool  # positions by NEOX rotary on q and k (``<arch>.rope.freq_base``), not a learned position_embd
    gated: bool  # the MLP is SwiGLU (silu(ffn_gate) * ffn_up), not GELU(ffn_up)


# the GGUF architectures this module runs
ENCODERS = {"bert": EncoderArch(rope=False, gated=False), "nomic-bert": EncoderArch(rope=True, gated=True)}


Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class EncoderLayer:
    qkv: Linear  # q, k and v's rows stacked (or the file's fused attn_qkv): one linear
    o: Linear
    attn_norm: tuple[torch.Tensor, torch.Tensor]  # (weight, bias) after attention
    up: Linear  # gated: the gate's rows, then the up's (one linear)
    down: Linear
    out_norm: tuple[torch.Tensor, torch.Tensor]  # after the MLP


class BertEncoder:
    """``make_linear`` (linear.linear_factory's, with the CPU kernels): the linears of a quantized file run on its
    own blocks through the kernels (``int8_layout``: the types served in the int8 layout), as the decoders'; None,
    or a float file's, dense float32."""

    def __init__(
        self, path: str | Path, make_linear: Callable | None = None, int8_layout: frozenset[str] = frozenset()
    ):
        from ..kernels.quant import stack
        from .gguf_blocks import packed
        from .gguf_meta import GGUFIndex

        index = GGUFIndex(path)
        fields = index.fields
        arch = fields["general.architecture"]
        if arch not in ENCODERS:
            raise ValueError(f"{path}: architecture {arch!r} is not an embedding model this server runs")

        def key(name: str, default=None):
            return fields.get(f"{arch}.{name}", default)

        self.arch = ENCODERS[arch]

        self.hidden = int(key("embedding_length"))
        self.heads = int(key("attention.head_count"))
        self.eps = float(key("attention.layer_norm_epsilon", 1e-12))
        self.context_length = int(key("context_length", 512))
        tensors = {t.name: t for t in index.tensors}
        # a classifier's file is a reranker whatever its key says (llama.cpp's --reranking pools it so)
        rank = "cls.output.weight" in tensors
        self.pooling = "rank" if rank else POOLING.get(int(key("pooling_type", 1)), "mean")

        def get(name: str) -> torch.Tensor:
            return _dequantize(tensors[name])

        def maybe(name: str) -> torch.Tensor | None:
            return get(name) if name in tensors else None

        def linear(*names: str) -> Linear:
            """One linear of these tensors' rows stacked (q, k and v: one call instead of three); biases where the
            file has them (nomic-bert's linears have none)."""
            biases = [maybe(f"{n}.bias") for n in names]
            rows = [int(tensors[f"{n}.weight"].shape[-1]) for n in names]  # (gguf's shapes are [in, out])
            zeros = [b if b is not None else torch.zeros(r) for b, r in zip(biases, rows)]
            bias = None if all(b is None for b in biases) else torch.cat(zeros)
            if make_linear is not None:
                blocks = [packed(tensors[f"{n}.weight"], int8_layout) for n in names]
                if all(b is not None for b in blocks):
                    return make_linear(stack(blocks), bias)
            weight = torch.cat([get(f"{n}.weight") for n in names])
            return lambda x: F.linear(x, weight, bias)

        self.token = get("token_embd.weight")
        self.position = None if self.arch.rope else get("position_embd.weight")
        self.rope_base = float(key("rope.freq_base", 10000.0))
        types = maybe("token_types.weight")
        self.token_type = types[0] if types is not None else torch.zeros(self.hidden)
        self.embed_norm = (get("token_embd_norm.weight"), get("token_embd_norm.bias"))
        self.layers = []
        for i in range(int(key("block_count"))):
            p = f"blk.{i}."
            fused = p + "attn_qkv.weight" in tensors
            self.layers.append(
                EncoderLayer(
                    qkv=linear(p + "attn_qkv") if fused else linear(p + "attn_q", p + "attn_k", p + "attn_v"),
                    o=linear(p + "attn_output"),
                    attn_norm=(get(p + "attn_output_norm.weight"), get(p + "attn_output_norm.bias")),
                    up=linear(p + "ffn_gate", p + "ffn_up") if self.arch.gated else linear(p + "ffn_up"),
                    down=linear(p + "ffn_down"),
                    out_norm=(get(p + "layer_output_norm.weight"), get(p + "layer_output_norm.bias")),
                )
            )
        # a cross-encoder (pooling rank): the first token through a dense layer and tanh, then the score
        self.cls = (maybe("cls.weight"), maybe("cls.bias"))
        self.cls_out = (maybe("cls.output.weight"), maybe("cls.output.bias"))
        self.dims = self.hidden

    @property
    def scores(self) -> bool:
        """Whether this is a reranker (one relevance score per input) rather than an embedding model."""
        return self.pooling == "rank"

    @torch.inference_mode()
    def forward(self, inputs: list[list[int]]) -> torch.Tensor:
        """Each input's pooled vector [B, hidden] (a reranker: its scores [B, 1]), unnormalized."""
        width = max(len(ids) for ids in inputs)
        ids = torch.zeros(len(inputs), width, dtype=torch.long)
        real = torch.zeros(len(inputs), width, dtype=torch.bool)
        for i, row in enumerate(inputs):
            ids[i, : len(row)] = torch.tensor(row)
            real[i, : len(row)] = True
        x = self.token[ids] + self.token_type
        if self.position is not None:
            x = x + self.position[:width][None]
        x = F.layer_norm(x, (self.hidden,), *self.embed_norm, self.eps)
        b, t, d = x.shape
        hd = d // self.heads
        rotary = self._rotary(t, hd) if self.arch.rope else None
        padded = not bool(real.all())
        mask = torch.zeros(b, 1, 1, t).masked_fill_(~real[:, None, None, :], float("-inf")) if padded else None
        x = x.reshape(b * t, d)  # (the linears take rows)
        for layer in self.layers:
            q, k, v = layer.qkv(x).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
            if rotary is not None:
                q, k = apply_rope(q, *rotary), apply_rope(k, *rotary)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b * t, d)
            x = F.layer_norm(x + layer.o(a), (d,), *layer.attn_norm, self.eps)
            if self.arch.gated:
                gate, up = layer.up(x).chunk(2, dim=-1)
                hidden = F.silu(gate) * up
            else:
                hidden = F.gelu(layer.up(x))
            x = F.layer_norm(x + layer.down(hidden), (d,), *layer.out_norm, self.eps)
        x = x.view(b, t, d)
        lengths = real.sum(1)
        if self.pooling == "cls" or self.pooling == "rank":
            pooled = x[:, 0]
        elif self.pooling == "last":
            pooled = x[torch.arange(b), lengths - 1]
        else:  # mean (and none: a vector for the input as a whole is what the routes return)
            pooled = (x * real[..., None]).sum(1) / lengths[:, None]
        if self.pooling != "rank":
            return pooled
        w, bias = self.cls
        if w is not None:
            pooled = torch.tanh(F.linear(pooled, w, bias))
        w, bias = self.cls_out
        if w is None:
            raise ValueError("a reranker's file has no classifier (cls.output)")
        return F.linear(pooled, w, bias)

    def _rotary(self, length: int, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [length, dims] of NEOX rotary over every position (llama.cpp's rope_ext, no scaling)."""
        inv_freq = 1.0 / self.rope_base ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims)
        freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _dequantize(tensor) -> torch.Tensor:
    """A GGUF tensor as float32, in torch's [out, in] layout."""
    import numpy as np
    from gguf.quants import dequantize

    data = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # gguf's shapes are [in, out]
    return torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))  # (a copy: the map is read-only)
