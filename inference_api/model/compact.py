"""The compact decoder: every architecture families.py describes, over the row KV cache.

One fused QKV and one fused gate/up projection per layer, rotary tables computed once for every position (one
table per rotary base: gemma3's sliding layers turn by their own), keys and values written in place into the
preallocated cache, and linears of whichever kind ``make_linear`` picked (oneDNN-packed float32, 8-bit or
4-bit weight groups, or dense on CUDA). The forward takes an explicit ForwardBatch; what differs between
families (norms, activation, q/k norms, soft-capping, sliding windows) comes from the ModelSpec, not from
branches per family. A decode step of every family without parallel layers (``ModelSpec.fused``) runs through
the kernels' Decoder, the loop's mirror in C++.
transformers' own modules stay the fallback for every other architecture.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..kernels.quant import QuantLinear
from .families import ModelSpec, describe
from .forward_batch import ForwardBatch
from .lora import LoraPairs, LoraPlan, LoraRows, LoraSlots

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: Linear
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    attn_norm_b: torch.Tensor | None = None  # LayerNorm biases (falcon)
    mlp_norm_b: torch.Tensor | None = None


def rotary_tables(config, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, rotary dims] for every position, with the config's rope base, type and scaling; a
    GGUF's per-frequency divisors as llama.cpp applies them (Llama 3's rope_freqs; Phi-3's LongRoPE short
    factors, or the long ones when the context passes the original one) and its attention factor."""
    rope_type = (getattr(config, "rope_scaling", None) or {}).get("rope_type", "default")
    if rope_type in ("default", "linear"):  # (every GGUF's: llama.cpp's scalings are the divisors below)
        inv_freq, scale = default_inv_freq(config, device), 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / config.rope_scaling["factor"]
    else:  # a transformers folder's other scalings (YaRN, dynamic, ...): transformers' own tables
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    factors = getattr(config, "rope_freq_factors", None)
    if getattr(config, "rope_factors_long", None) is not None:
        long = length - 1 > config.rope_original_context
        factors = config.rope_factors_long if long else config.rope_factors_short
    if factors is not None:
        inv_freq = inv_freq / torch.tensor(factors, device=device, dtype=inv_freq.dtype)
    scale = scale * getattr(config, "rope_attn_factor", 1.0)
    freqs = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq.float())
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).contiguous(), (emb.sin() * scale).contiguous()


def default_inv_freq(config, device) -> torch.Tensor:
    """The rotary frequencies base^(-2i/d) over the rotary dims (transformers' default rope, computed alike)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (config.rope_theta**exponents)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over the leading cos.shape[-1] dims of x (all of them unless the model's rotary is partial)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = rot // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _act(x: torch.Tensor, activation: str) -> torch.Tensor:
    return F.gelu(x, approximate="tanh") if activation == "gelu_tanh" else F.silu(x)


def _pad(x: torch.Tensor, tokens: torch.Tensor, total: int) -> torch.Tensor:
    """Rows x [N, ...] placed at indices tokens of a zeroed [total, ...] (the padded layout)."""
    if x.shape[0] == total:  # no padding: tokens is 0..total-1
        return x
    return x.new_zeros(total, *x.shape[1:]).index_copy_(0, tokens, x)


QUERY_BLOCK = 128  # prefill attention runs this many queries at a time


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the additive one SDPA applies (0 where visible, -inf elsewhere), made once a
    step: SDPA turns a boolean mask into this in every call, three kernels a layer on CUDA. Every query sees at
    least one position (ForwardBatch.visible), so no row is all -inf."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """Attention over blocks of queries: the same result at the same speed, with temporaries of about 4 MB for
    512 queries over 2048 positions instead of 76 MB in one call (measured on the 2-core machine). SDPA, or the
    scores written out where they are soft-capped (gemma2: cap * tanh(scores / cap) before the softmax); mask is
    additive (_additive). One query a row (decode) with grouped heads runs as queries of their key/value head: no
    copy of the keys, and on CUDA a masked SDPA stays off its slow math kernel."""
    b, heads, queries, dim = q.shape
    kv_heads = keys.shape[1]
    if queries == 1 and kv_heads != heads:  # one query a row: each key/value head's query heads as its queries
        grouped = _attention(q.reshape(b, kv_heads, heads // kv_heads, dim), keys, values, mask, scale, softcap)
        return grouped.reshape(b, heads, 1, dim)
    gqa = kv_heads != heads
    if softcap is not None and gqa:
        keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        values = values.repeat_interleave(q.shape[1] // values.shape[1], dim=1)

    def block(qb: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        if softcap is None:
            return F.scaled_dot_product_attention(qb, keys, values, attn_mask=mb, scale=scale, enable_gqa=gqa)
        scores = torch.tanh(qb @ keys.transpose(-1, -2) * (scale / softcap)) * softcap
        return scores.add_(mb).softmax(-1).to(values.dtype) @ values

    if q.shape[2] <= QUERY_BLOCK:  # one block (every decode step): no copy through cat
        return block(q, mask)
    return torch.cat(
        [
            block(q[:, :, i : i + QUERY_BLOCK], mask[:, :, i : i + QUERY_BLOCK])
            for i in range(0, q.shape[2], QUERY_BLOCK)
        ],
        dim=2,
    )


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The all-reduce of a model that is not split: its own sums are whole already."""
    return t


class CompactLM:
    """forward(batch, cache) -> float32 logits: [B, V] for each entry's last token, or [B, T, V] (None on a
    tensor-parallel rank other than 0, which holds no head).

    all_reduce: a tensor-parallel rank's sum over every rank of a row-split layer's partial outputs (attention's o
    and the MLP's down), in place; None: the model is not split. spec then holds this rank's own head counts."""

    def __init__(
        self,
        spec: ModelSpec,
        embed: Callable[[torch.Tensor], torch.Tensor],
        embed_scale: float,
        layers: list[Layer],
        norm: torch.Tensor,
        head: Linear | None,
        length: int,
        device,
        dtype: torch.dtype,
        kernels=None,
        norm_b: torch.Tensor | None = None,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.kernels = kernels if torch.device(device).type == "cpu" and dtype == torch.float32 else None
        self.split = all_reduce is not None
        self.all_reduce = all_reduce or _whole
        self.spec = spec
        self.embed, self.embed_scale, self.layers, self.norm, self.head = embed, embed_scale, layers, norm, head
        self.norm_b = norm_b
        self.heads, self.kv_heads, self.head_dim, self.eps = spec.heads, spec.kv_heads, spec.head_dim, spec.eps
        self.dtype = dtype
        # one cos and sin table per rotary base, in the model's dtype as transformers casts them
        self.ropes = [tuple(t.to(dtype) for t in rotary_tables(c, length, device)) for c in spec.ropes]
        # rotary + cache write in one kernel call for any family whose rotary turns whole heads
        self.rope_kernel = self.kernels is not None and spec.rot_dim == spec.head_dim
        # the Decoder runs a decode step in one C++ call (the families ModelSpec.fused names): none where the sums
        # go through an all-reduce
        fits = self.kernels is not None and spec.fused and not self.split
        self.fused, self.fused_max_rows = fused_decoder(self.kernels if fits else None, layers, spec)
        self.lora: LoraSlots | None = None  # the LoRA adapters held (ModelRunner.add_adapter), None: none ever

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm as transformers computes it: in float32, the weight applied after the cast back (the CPU
        kernels: the same in one pass); Gemma's weight - 1 was made whole at load. LayerNorm for falcon.
        F.rms_norm without a weight is that computation (bit for bit on CPU, where torch composes it of the
        same six operations); on CUDA it is one fused kernel where the spelled-out form launched eight."""
        if self.spec.family.norm == "layer":
            return F.layer_norm(x, x.shape[-1:], weight, bias, self.eps)
        if self.kernels is not None:
            return self.kernels.rms_norm(x, weight, self.eps)
        return weight * F.rms_norm(x, x.shape[-1:], eps=self.eps)

    def _linear(self, lin: Linear, i: int, role: str, x: torch.Tensor, lora: LoraPlan | None) -> torch.Tensor:
        """Layer i's linear ``role`` over the real tokens x: the base weights once for every token, then the
        adapters' low-rank terms added to their own tokens' outputs (the others' numbers untouched)."""
        y = lin(x)
        if lora is None or self.lora is None:
            return y
        return self.lora.add_delta(i, role, x, y, lora)

    def _mlp(self, layer: Layer, h: torch.Tensor, i: int, lora: LoraPlan | None) -> torch.Tensor:
        up = self._linear(layer.gate_up, i, "gate_up", h, lora)
        if not self.spec.family.gated:  # act(up), no gate (falcon)
            act = _act(up, self.spec.activation)
        elif self.kernels is not None and self.spec.activation == "silu":
            act = self.kernels.silu_mul(up)
        else:
            gate, up = up.chunk(2, dim=-1)  # [gate | up]
            act = _act(gate, self.spec.activation).mul_(up)
        return self._linear(layer.down, i, "down", act, lora)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).to(self.dtype)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is None:  # (forward asks only a rank that has the head)
            raise RuntimeError("this rank computes no logits")
        logits = self.head(self._norm(x, self.norm, self.norm_b)).float()
        cap = self.spec.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def forward(self, batch: ForwardBatch, cache) -> torch.Tensor | None:
        """The one layer loop (every family, every batch); a decode step goes to the kernels'
        Decoder, its mirror in C++, where it takes the rows, with the rows' LoRA adapters' terms where the kernels
        add them (``LoraPairs``; else the loop adds them, giving the other rows the same numbers, bit for bit)."""
        lora: LoraPlan | None = None
        if self.lora is not None and batch.lora_rows is not None:
            lora = LoraRows(*batch.lora_rows)
        elif self.lora is not None and batch.adapters:
            lora = self.lora.plan(batch.adapter_tokens(), int(batch.tokens.shape[0]))
        fused = self.fused is not None and self.head is not None and (lora is None or isinstance(lora, LoraPairs))
        if fused and batch.decode and not batch.static and batch.shape[0] <= self.fused_max_rows:
            return self._fused(batch, cache, lora)
        spec, k = self.spec, self.kernels
        b, t = batch.shape
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        # the real tokens only ([N], the padding of shorter chunks and a decode step's idle rows left out) through
        # the norms, the linears, the rotary + cache write and, on CPU, attention: each token's numbers are then
        # the same whatever else is in the batch and however its prompt was chunked
        tokens, rows, pos, write = batch.tokens, batch.token_rows, batch.token_positions, batch.token_writes
        x = self._embed(batch.ids.reshape(-1)[tokens])
        # each token's slot in each layer's cache (a sliding-window layer's ring wraps), once per cache geometry
        slots = {n: cache.slots_of(n, write) for n in set(cache.layer_slots)}
        flats = {} if self.rope_kernel else {n: cache.flat_index(rows, s, n) for n, s in slots.items()}
        cos_sin = [(cos[pos], sin[pos]) for cos, sin in self.ropes]  # [N, rotary dims], once for every layer
        per_token = k is not None  # the attention kernel, one query at a time
        rope_k = k if self.rope_kernel else None  # the rotary + cache write kernel
        if per_token:
            lengths = pos + 1
            starts = self._window_starts(pos)
        else:  # SDPA over the padded [B, T] layout
            masks = {w: _additive(batch.visible(w)[:, None], self.dtype) for w in set(spec.windows)}  # [B, 1, T, L]
        parallel = spec.family.parallel
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer.attn_norm, layer.attn_norm_b)
            qkv = self._linear(layer.qkv, i, "qkv", h, lora)
            cos, sin = cos_sin[spec.rope[i]]
            if rope_k is not None:  # every token's rotary and cache write in one kernel call
                # the per-head norms before the rotary, written back into qkv
                if layer.q_norm is not None and layer.k_norm is not None:
                    heads = qkv.view(-1, hq + 2 * hk, d)
                    heads[:, :hq] = self._norm(heads[:, :hq], layer.q_norm)
                    heads[:, hq : hq + hk] = self._norm(heads[:, hq : hq + hk], layer.k_norm)
                q = rope_k.rope_store(
                    qkv,
                    cos,
                    sin,
                    cache.keys[i],
                    cache.values[i],
                    *cache.scales(i),
                    slots[cache.layer_slots[i]],
                    hq,
                    rows,
                )
            else:
                qk, v = qkv.split([(hq + hk) * d, hk * d], dim=-1)
                qk, v = qk.reshape(-1, hq + hk, d), v.reshape(-1, hk, d)
                if layer.q_norm is not None and layer.k_norm is not None:
                    qk = torch.cat([self._norm(qk[:, :hq], layer.q_norm), self._norm(qk[:, hq:], layer.k_norm)], 1)
                # the queries' and the keys' rotary in one pass (a decode step on CUDA is bound by its launches)
                q, key = apply_rope(qk, cos[:, None], sin[:, None]).split([hq, hk], dim=1)
                if k is not None:  # (the attention kernel reads whole rows of heads)
                    q = q.contiguous()
                cache.write(i, key, v, flats[cache.layer_slots[i]])
            if k is not None:  # per_token
                a = k.decode_attention(
                    q.reshape(-1, hq, d),
                    cache.keys[i],
                    cache.values[i],
                    *cache.scales(i),
                    lengths,
                    spec.attn_scale,
                    rows,
                    starts[spec.windows[i]],
                    spec.attn_softcap or 0.0,
                    cache.ring(i),
                ).view(-1, hq * d)
            else:
                keys, values = cache.read(i, batch.cache_rows, batch.attend, q.dtype)
                if keys.dtype != q.dtype:  # a 16-bit cache: attention itself in the model's dtype
                    keys, values = keys.to(q.dtype), values.to(q.dtype)
                qp = _pad(q.reshape(-1, hq * d), tokens, b * t).view(b, t, hq, d).transpose(1, 2)
                a = _attention(qp, keys, values, masks[spec.windows[i]], spec.attn_scale, spec.attn_softcap)
                a = a.transpose(1, 2).reshape(b * t, hq * d)
                if a.shape[0] != x.shape[0]:  # padding to drop (none in a static batch: every entry is a token)
                    a = a[tokens]
            o = self._linear(layer.o, i, "o", a, lora)
            if parallel:  # the MLP reads the layer's input too (its own norm, or the attention's)
                if layer.post_attn_norm is not None:  # (no such family; a split one is refused: parallel.Shard)
                    o = self._norm(o, layer.post_attn_norm)
                same = layer.mlp_norm is layer.attn_norm
                m = self._mlp(layer, h if same else self._norm(x, layer.mlp_norm, layer.mlp_norm_b), i, lora)
                if self.split:  # one all-reduce for both partial sums
                    x.add_(self.all_reduce(o.add_(m)))
                else:
                    x.add_(o).add_(m)
                continue
            o = self.all_reduce(o)
            if layer.post_attn_norm is not None:
                o = self._norm(o, layer.post_attn_norm)
            x.add_(o)  # x is this forward's own tensor
            m = self.all_reduce(self._mlp(layer, self._norm(x, layer.mlp_norm, layer.mlp_norm_b), i, lora))
            if layer.post_mlp_norm is not None:
                m = self._norm(m, layer.post_mlp_norm)
            x.add_(m)
        if self.head is None:  # a tensor-parallel rank other than 0: rank 0 computes the logits
            return None
        if batch.hidden:  # every real token's vector after the final norm (an embedding model's tokens)
            return _pad(self._norm(x, self.norm, self.norm_b), tokens, b * t).view(b, t, -1)
        if batch.last_only:  # each entry's last token is real (chunks are left-padded)
            return self._logits(x if batch.static else x[batch.last])
        return _pad(self._logits(x), tokens, b * t).view(b, t, -1)

    def _window_starts(self, pos: torch.Tensor) -> dict[int | None, torch.Tensor | None]:
        """Each sliding window's first attended position for queries at positions pos (None: the whole context)."""
        return {w: None if w is None else (pos - (w - 1)).clamp(min=0) for w in set(self.spec.windows)}

    def _fused(self, batch: ForwardBatch, cache, lora: LoraPlan | None = None) -> torch.Tensor:
        """A decode step of rows 0..B-1 through the kernels' Decoder: the layers of ``forward``'s loop in one C++
        call (csrc/decoder.cpp, its mirror, checked bit for bit against it by tests/test_quality.py and
        tests/test_architectures.py), with the LoRA terms of ``lora`` after each linear as the loop adds them.
        Returns logits [B, V]."""
        k, spec = self.kernels, self.spec
        if k is None or self.head is None:  # (forward takes this path only with the Decoder and the head)
            raise RuntimeError("the Decoder runs on the CPU kernels, on the rank with the head")
        pos, write = batch.positions[:, 0], batch.write[:, 0]
        tables = [(cos[pos], sin[pos]) for cos, sin in self.ropes]
        # each cache geometry's slots (idle rows compute here, the loop never sees them: slots_of keeps them in
        # each ring's own scratch slot)
        slots = {n: cache.slots_of(n, write) for n in set(cache.layer_slots)}
        starts = self._window_starts(pos)
        layers = range(len(self.layers))
        args = (
            self._embed(batch.ids[:, 0]),
            [tables[spec.rope[i]][0] for i in layers],
            [tables[spec.rope[i]][1] for i in layers],
            [slots[cache.layer_slots[i]] for i in layers],
            [starts[spec.windows[i]] for i in layers],
            [cache.ring(i) for i in layers],
            batch.lengths(),
            cache.keys,
            cache.values,
            cache.key_scales,
            cache.value_scales,
        )
        if isinstance(lora, LoraPairs) and self.lora is not None:  # the pairs' tokens as the step's rows
            rows = batch.tokens.index_select(0, lora.index)
            x = self.fused.forward_lora(*args, self.lora.pieces, rows, lora.places, lora.scales)
        else:
            x = self.fused.forward(*args)
        return self._logits(x)


def fused_decoder(kernels, layers: list[Layer], spec: ModelSpec) -> tuple[Any, float]:
    """The kernels' Decoder (the decode step's layers in one C++ call) when every linear is quantized, and
    the most rows it may take: one where layers run several rows on a oneDNN copy (SplitLinear), else any."""
    if kernels is None:
        return None, 0
    one_row = [
        [getattr(lin, "quantized", lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] for layer in layers
    ]  # SplitLinear: its quantized half
    quantized = [[lin for lin in four if isinstance(lin, QuantLinear)] for four in one_row]
    if any(len(four) < 4 for four in quantized):
        return None, 0
    decoder = kernels.Decoder(
        [
            (
                layer.attn_norm,
                qkv.parts(),
                o.parts(),
                layer.mlp_norm,
                gu.parts(),
                down.parts(),
                layer.q_norm,
                layer.k_norm,
                layer.post_attn_norm,
                layer.post_mlp_norm,
            )
            for layer, (qkv, o, gu, down) in zip(layers, quantized)
        ],
        spec.heads,
        spec.eps,
        spec.activation == "gelu_tanh",
        spec.attn_scale,
        spec.attn_softcap or 0.0,
    )
    split = any(lin is not layer.qkv for layer, (lin, *_) in zip(layers, one_row))
    return decoder, 1 if split else math.inf


class HFWeights:
    """A loaded transformers model's weights by role, for build_compact: its own tensor names (the family's),
    Gemma's norms made whole (1 + w); each layer leaves the model once packed (the model is used up)."""

    def __init__(self, model, family):
        self.model, self.family = model, family
        self.sd = {k: v.detach() for k, v in model.state_dict().items()}

    def embed(self) -> torch.Tensor:
        return self.sd["model.embed_tokens.weight"]

    def head(self) -> torch.Tensor | None:
        return self.sd.get("lm_head.weight")

    def _norm(self, name: str | None) -> torch.Tensor | None:
        w = self.sd.get(f"{name}.weight") if name else None
        offset = self.family.norm_offset
        return None if w is None else (w.float() + offset).to(w.dtype) if offset else w.clone()

    def final_norm(self) -> torch.Tensor:
        norm = self._norm("model.norm")
        if norm is None:
            raise ValueError("the model has no final norm (model.norm.weight)")
        return norm

    def layer(self, i: int) -> dict[str, Any]:
        p, names, sd = f"model.layers.{i}.", self.family.names, self.sd

        def fused(parts: list[str], name: str | None, suffix: str = "weight") -> torch.Tensor | None:
            if name:
                return sd.get(f"{p}{name}.{suffix}")
            found = [sd.get(f"{p}{part}.{suffix}") for part in parts]
            present = [f for f in found if f is not None]
            return torch.cat(present) if len(present) == len(found) else None

        attn = [f"self_attn.{n}_proj" for n in "qkv"]
        norm = lambda role: self._norm(p + names[role]) if names[role] else None  # noqa: E731
        return dict(
            attn_norm=norm("attn_norm"),
            qkv=fused(attn, names["qkv"]),
            qkv_bias=fused(attn, names["qkv"], "bias"),
            o=sd[p + "self_attn.o_proj.weight"],
            o_bias=sd.get(p + "self_attn.o_proj.bias"),
            mlp_norm=norm("mlp_norm"),
            gate_up=fused(["mlp.gate_proj", "mlp.up_proj"], names["gate_up"]),
            down=sd[p + "mlp.down_proj.weight"],
            q_norm=norm("q_norm"),
            k_norm=norm("k_norm"),
            post_attn_norm=norm("post_attn_norm"),
            post_mlp_norm=norm("post_mlp_norm"),
        )

    def drop_layer(self, i: int) -> None:
        """A packed layer's dense weights go at once, which keeps the start-up peak low."""
        self.model.model.layers[i] = torch.nn.Identity()
        for name in [k for k in self.sd if k.startswith(f"model.layers.{i}.")]:
            del self.sd[name]


def build_compact(
    model,
    make_linear: Callable,
    embed_fn: Callable,
    length: int,
    kernels=None,
    shard=None,
    all_reduce: Callable | None = None,
) -> CompactLM:
    """A CompactLM from a transformers model of a described architecture, or from a GGUFModel (its weights read
    straight from the file): tensors are copied or quantized one layer at a time. shard (parallel.Shard): only this
    tensor-parallel rank's share of each layer is kept, sliced before make_linear quantizes or packs it."""
    config = model.config
    spec = describe(config)
    src = model.weights() if hasattr(model, "weights") else HFWeights(model, spec.family)
    # the head first, while little else is resident: its quantization passes hold a few float32 copies
    embed_w, head_w = src.embed(), src.head()
    rows = src.file_rows() if hasattr(src, "file_rows") else None  # a GGUF's token embedding in its file
    embed, head = embed_fn(embed_w, embed_w if config.tie_word_embeddings or head_w is None else head_w, rows)
    del head_w

    placed: dict[int, torch.Tensor] = {}  # the current layer's norms as placed, by the tensor read

    def place(t: torch.Tensor | None) -> torch.Tensor | None:
        """A norm's weight on the model's device in its dtype (a GGUF's are read as float32 on the CPU); a tensor
        that serves twice in a layer (falcon's one LayerNorm) placed once, so it stays one (CompactLM.forward)."""
        if t is None:
            return None
        if id(t) not in placed:
            placed[id(t)] = t.to(model.device, model.dtype)
        return placed[id(t)]

    layers = []
    for i in range(config.num_hidden_layers):
        placed.clear()  # (ids are only unique among live tensors: this layer's, held by w)
        w = src.layer(i)
        if shard is not None:
            w = shard.split_layer(w, spec, i)
        bias = None if w["qkv_bias"] is None else w["qkv_bias"].float()
        modes = w.get("modes", {})  # a GGUF's: the mode that keeps each linear's own tensor types
        linear = lambda role, b=None, w=w, modes=modes: make_linear(w[role], b, as_mode=modes.get(role))  # noqa: E731
        layers.append(
            Layer(
                attn_norm=place(w["attn_norm"]),
                qkv=linear("qkv", bias),
                o=linear("o", w["o_bias"]),
                mlp_norm=place(w["mlp_norm"]),
                gate_up=linear("gate_up"),
                down=linear("down"),
                q_norm=place(w["q_norm"]) if spec.family.qk_norm else None,
                k_norm=place(w["k_norm"]) if spec.family.qk_norm else None,
                post_attn_norm=place(w["post_attn_norm"]),
                post_mlp_norm=place(w["post_mlp_norm"]),
                attn_norm_b=place(w.get("attn_norm_b")),
                mlp_norm_b=place(w.get("mlp_norm_b")),
            )
        )
        del w
        src.drop_layer(i)
    placed.clear()
    embed_scale = config.hidden_size**0.5 if spec.family.embed_scale else 1.0
    final_b = place(src.final_norm_bias()) if hasattr(src, "final_norm_bias") else None
    return CompactLM(
        shard.local(spec) if shard is not None else spec,
        embed,
        embed_scale,
        layers,
        place(src.final_norm()),
        head,
        length,
        model.device,
        model.dtype,
        kernels,
        final_b,
        all_reduce,
    )
