"""Embedding models from a GGUF, as llama.cpp's bert graph runs them (``ENCODERS``: bert, and nomic-bert as
nomic-embed-text converts): tokens and token types (BERT also learned positions) embedded and normalized, then
per layer bidirectional attention (nomic-bert: NEOX rotary on q and k) and an MLP (BERT: GELU in its tanh form;
nomic-bert: SwiGLU), each added to the residual and layer-normalized after (post-norm), and the token vectors pooled
as the file says (``<arch>.pooling_type``: mean, cls, last; rank: a cross-encoder's classifier head gives one
score).

The weights are read from the file by llama.cpp's tensor names: a quantized file's linears run on its own blocks
through the CPU kernels (int8 inputs, as llama.cpp rounds its activations), a float file's dense in float32; the
rest is torch's but attention: the inputs' tokens are packed one after another without padding, and attention
(the kernels' ``encoder_attention``, else torch's SDPA an input at a time) keeps each input to its own tokens, so
an input's vector does not depend on what else shares its batch (the kernels compute each row alone).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .compact import apply_rope
from .families import ENCODERS

# llama.cpp's pooling types (LLAMA_POOLING_TYPE_*)
POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


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
    or a float file's, dense float32. ``kernels`` (the loaded CPU kernels): attention through their
    ``encoder_attention``; None, torch's."""

    def __init__(
        self,
        path: str | Path,
        make_linear: Callable | None = None,
        int8_layout: frozenset[str] = frozenset(),
        kernels=None,
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
        self.kernels = kernels

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
        """Each input's pooled vector [B, hidden] (a reranker: its scores [B, 1]), unnormalized. The inputs' tokens
        packed one after another (no padding): every step but attention is per token, and attention keeps each
        input to itself (``_attention``)."""
        lengths = [len(ids) for ids in inputs]
        ids = torch.tensor([t for row in inputs for t in row], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lengths])
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        x = self.token[ids] + self.token_type
        if self.position is not None:
            x = x + self.position[positions]
        x = F.layer_norm(x, (self.hidden,), *self.embed_norm, self.eps)
        tokens, d = x.shape
        hd = d // self.heads
        rotary = [r[positions][:, None] for r in self._rotary(max(lengths), hd)] if self.arch.rope else None
        spans = torch.tensor(offsets)  # (the kernel's offsets, made once a forward)
        for layer in self.layers:
            q, k, v = layer.qkv(x).split(d, dim=-1)
            if rotary is not None:
                q, k = (apply_rope(t.view(tokens, self.heads, hd), *rotary).view(tokens, d) for t in (q, k))
            x = F.layer_norm(x + layer.o(self._attention(q, k, v, offsets, spans)), (d,), *layer.attn_norm, self.eps)
            x = F.layer_norm(x + layer.down(self._activation(layer.up(x))), (d,), *layer.out_norm, self.eps)
        if self.pooling == "cls" or self.pooling == "rank":
            pooled = x[offsets[:-1]]
        elif self.pooling == "last":
            pooled = x[[end - 1 for end in offsets[1:]]]
        else:  # mean (and none: a vector for the input as a whole is what the routes return)
            pooled = torch.stack([row.mean(0) for row in x.split(lengths)])
        if self.pooling != "rank":
            return pooled
        w, bias = self.cls
        if w is not None:
            pooled = torch.tanh(F.linear(pooled, w, bias))
        w, bias = self.cls_out
        if w is None:
            raise ValueError("a reranker's file has no classifier (cls.output)")
        return F.linear(pooled, w, bias)

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's activation of its up projection: SwiGLU (silu(gate) * up of [gate | up]) or GELU in its tanh
        form, as llama.cpp's bert graph (ggml_gelu); the kernels' one pass, else torch's."""
        if self.arch.gated:
            if self.kernels is not None:
                return self.kernels.silu_mul(x)
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up
        return self.kernels.gelu(x) if self.kernels is not None else F.gelu(x, approximate="tanh")

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: list[int], spans: torch.Tensor
    ) -> torch.Tensor:
        """Bidirectional attention of the packed inputs (q, k, v [tokens, hidden]; input i's tokens the rows
        offsets[i] .. offsets[i + 1] - 1, ``spans`` the same as a tensor), each over its own tokens alone: the
        kernels' (one call for every input and head), else torch's SDPA an input at a time."""
        hd = q.shape[-1] // self.heads
        if self.kernels is not None:
            return self.kernels.encoder_attention(q, k, v, spans, self.heads, hd**-0.5)
        out = torch.empty(q.shape)
        for start, end in zip(offsets, offsets[1:]):
            qi, ki, vi = (t[start:end].reshape(1, end - start, self.heads, hd).transpose(1, 2) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qi, ki, vi).transpose(1, 2).reshape(end - start, -1)
        return out

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
