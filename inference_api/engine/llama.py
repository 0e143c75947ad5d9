"""A compact llama-family decoder (llama, mistral, qwen2) over the row KV cache.

One fused QKV and one fused gate/up projection per layer, rotary tables computed once for every
position, keys and values written in place into the preallocated cache, and linears of whichever kind
``make_linear`` picked (oneDNN-packed float32, 8-bit or 4-bit weight groups, or dense on CUDA).
transformers' own modules stay the fallback for every other architecture.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .quant import QuantLinear

ARCHITECTURES = ("llama", "mistral", "qwen2")

Linear = Callable[[torch.Tensor], torch.Tensor]


def supports(config) -> bool:
    return (config.model_type in ARCHITECTURES and getattr(config, "hidden_act", "silu") == "silu"
            and not getattr(config, "mlp_bias", False)
            and (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) % 2 == 0)


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: Linear
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def rotary_tables(config, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] for every position, with the model's rope type and scaling."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = (getattr(config, "rope_scaling", None) or {}).get("rope_type", "default")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    freqs = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq.float())
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).contiguous(), (emb.sin() * scale).contiguous()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the fused projection's output [..., 2F] = [gate | up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def _pad(x: torch.Tensor, tokens: torch.Tensor, total: int) -> torch.Tensor:
    """Rows x [N, ...] placed at indices tokens of a zeroed [total, ...] (the padded layout)."""
    if x.shape[0] == total:  # no padding: tokens is 0..total-1
        return x
    return x.new_zeros(total, *x.shape[1:]).index_copy_(0, tokens, x)


QUERY_BLOCK = 128  # prefill attention runs this many queries at a time


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gqa: bool) -> torch.Tensor:
    """SDPA over blocks of queries: the same result at the same speed, with temporaries of about 4 MB for
    512 queries over 2048 positions instead of 76 MB in one call (measured on the 2-core machine)."""
    return torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + QUERY_BLOCK], keys, values,
                                                     attn_mask=mask[:, :, i:i + QUERY_BLOCK], enable_gqa=gqa)
                      for i in range(0, q.shape[2], QUERY_BLOCK)], dim=2)


class CompactLM:
    """forward(ids, positions, visible, cache, last_only) -> float32 logits; the cache is bound by the caller."""

    def __init__(self, config, embed: Callable[[torch.Tensor], torch.Tensor], layers: list[Layer],
                 norm: torch.Tensor, head: Linear, length: int, device, dtype: torch.dtype, kernels=None):
        self.kernels = kernels if torch.device(device).type == "cpu" and dtype == torch.float32 else None
        self.embed, self.layers, self.norm, self.head = embed, layers, norm, head
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.dtype = dtype
        self.cos, self.sin = (t.to(dtype) for t in rotary_tables(config, length, device))  # as transformers casts
        self.fused, self.fused_max_rows = fused_decoder(self.kernels, layers, self.heads, self.eps)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as transformers computes it: in float32, the weight applied after the cast back (the CPU
        kernels: the same in one pass)."""
        if self.kernels is not None:
            return self.kernels.rms_norm(x, weight, self.eps)
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up) if self.kernels is not None else _silu_mul(gate_up)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, cache,
                last_only: bool = True) -> torch.Tensor:
        if ids.shape[1] == 1 and self.kernels is not None and cache.rows_in_order:  # not a one-token prefill
            return self._decode(ids[:, 0], positions[:, 0], visible[:, 0].sum(-1), cache)
        b, t = ids.shape
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        mask = visible[:, None]  # [B, 1, T, L] bool
        # the real tokens only ([N], the padding of shorter chunks left out) through the norms, the linears and
        # the rotary + cache write; attention alone runs on the padded [B, T] layout
        real = (cache.write_positions != cache.scratch).reshape(-1)
        tokens = real.nonzero()[:, 0]  # [N] indices into B * T
        x = self.embed(ids.reshape(-1)[tokens]).to(self.dtype)
        k = self.kernels
        if k is not None:  # every token's rotary and cache write in one kernel call per layer
            pos = positions.reshape(-1)[tokens]
            cos, sin = self.cos[pos], self.sin[pos]  # [N, D]
            rows = cache.bound_rows().repeat_interleave(t)[tokens]  # each token's cache row, once for every layer
            write = cache.write_positions.reshape(-1)[tokens]
        else:
            cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, T, D]
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(self._norm(x, layer.attn_norm))
            if k is not None:
                q = _pad(k.rope_store(qkv, cos, sin, cache.keys[i], cache.values[i], *cache.scales(i), write, hq, rows),
                         tokens, b * t).view(b, t, hq, d).transpose(1, 2)
                keys, values = cache.read(i, q.dtype)
            else:  # padding writes zeros into the scratch slot
                q, key, v = _pad(qkv, tokens, b * t).view(b, t, hq + 2 * hk, d).transpose(1, 2).split([hq, hk, hk], dim=1)
                keys, values = cache.update(_rope(key, cos, sin), v, i)
                q = _rope(q, cos, sin)
            if keys.dtype != q.dtype:  # a 16-bit cache: attention itself in the model's dtype
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            a = _attention(q, keys, values, mask, hk != hq).transpose(1, 2).reshape(b * t, hq * d)[tokens]
            x.add_(layer.o(a))  # x is this forward's own tensor
            x.add_(layer.down(self._silu_mul(layer.gate_up(self._norm(x, layer.mlp_norm)))))
        if last_only:  # each chunk's last token is real (chunks are left-padded): the last of its row's tokens
            return self.head(self._norm(x[real.view(b, t).sum(1).cumsum(0) - 1], self.norm)).float()[:, None]
        return _pad(self.head(self._norm(x, self.norm)).float(), tokens, b * t).view(b, t, -1)

    def _decode(self, ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, cache) -> torch.Tensor:
        """One token per row through the CPU kernels: a few calls per layer, each row reading only its
        own cached positions. Returns logits [B, 1, V]."""
        k, d = self.kernels, self.head_dim
        write = cache.write_positions[:, 0]
        cos, sin = self.cos[positions], self.sin[positions]
        x = self.embed(ids).to(self.dtype)
        if self.fused is not None and x.shape[0] <= self.fused_max_rows:
            x = self.fused.forward(x, cos, sin, write, lengths, cache.keys, cache.values, cache.key_scales,
                                   cache.value_scales)
            return self.head(k.rms_norm(x, self.norm, self.eps))[:, None]
        for i, layer in enumerate(self.layers):
            keys, values = cache.keys[i], cache.values[i]
            key_scales, value_scales = cache.scales(i)
            q = k.rope_store(layer.qkv(k.rms_norm(x, layer.attn_norm, self.eps)), cos, sin, keys, values,
                             key_scales, value_scales, write, self.heads)
            a = k.decode_attention(q, keys, values, key_scales, value_scales, lengths, d ** -0.5)
            x = x + layer.o(a.view(x.shape[0], -1))
            x = x + layer.down(k.silu_mul(layer.gate_up(k.rms_norm(x, layer.mlp_norm, self.eps))))
        return self.head(k.rms_norm(x, self.norm, self.eps))[:, None]


def fused_decoder(kernels, layers: list[Layer], heads: int, eps: float) -> tuple[object | None, float]:
    """The kernels' Decoder (the decode step's layers in one C++ call) when every linear is quantized, and
    the most rows it may take: one where layers run several rows on a oneDNN copy (SplitLinear), else any."""
    if kernels is None:
        return None, 0
    one_row = [[getattr(lin, "quantized", lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
               for layer in layers]  # SplitLinear: its quantized half
    if not all(isinstance(lin, QuantLinear) for four in one_row for lin in four):
        return None, 0
    decoder = kernels.Decoder([(layer.attn_norm, qkv.parts(), o.parts(), layer.mlp_norm, gu.parts(), down.parts())
                               for layer, (qkv, o, gu, down) in zip(layers, one_row)], heads, eps)
    split = any(lin is not layer.qkv for layer, (lin, *_) in zip(layers, one_row))
    return decoder, 1 if split else math.inf


def build_compact(model, make_linear: Callable, embed_fn: Callable, length: int, kernels=None) -> CompactLM:
    """Take a loaded transformers llama-family model apart into a CompactLM: its tensors are copied or
    quantized, and each decoder layer leaves the model once packed (the model is used up)."""
    config = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    # the head first, while little else is resident: its quantization passes hold a few float32 copies
    embed_w = sd["model.embed_tokens.weight"]
    head_w = embed_w if config.tie_word_embeddings or "lm_head.weight" not in sd else sd["lm_head.weight"]
    embed, head = embed_fn(embed_w, head_w)
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        att = p + "self_attn."
        if i:  # the previous layer is packed: its dense weights go now, which keeps the start-up peak low
            model.model.layers[i - 1] = torch.nn.Identity()
            for name in [k for k in sd if k.startswith(f"model.layers.{i - 1}.")]:
                del sd[name]
        qkv_bias = None
        if att + "q_proj.bias" in sd:
            qkv_bias = torch.cat([sd[att + n + "_proj.bias"] for n in "qkv"]).float()
        layers.append(Layer(
            attn_norm=sd[p + "input_layernorm.weight"].clone(),
            qkv=make_linear(torch.cat([sd[att + n + "_proj.weight"] for n in "qkv"]), qkv_bias),
            o=make_linear(sd[att + "o_proj.weight"], sd.get(att + "o_proj.bias")),
            mlp_norm=sd[p + "post_attention_layernorm.weight"].clone(),
            gate_up=make_linear(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]), None),
            down=make_linear(sd[p + "mlp.down_proj.weight"], None)))
    return CompactLM(config, embed, layers, sd["model.norm.weight"].clone(), head, length, model.device,
                     model.dtype, kernels)
