"""The architectures the compact decoder runs, each described once (as llama.cpp's per-architecture tables and
vLLM's model registry do): a ``Family`` says what a family does differently (norms, activation, q/k norms,
embedding scale, its tensor names), and ``describe`` reads one model's numbers from its transformers config
(attention scale, soft-capping, each layer's sliding window and rotary base). compact.py runs any of them
through the same layers; everything else runs on transformers' own modules (the fallback).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + weight): Gemma's norms store weight - 1
    activation: str = "silu"  # the gated MLP's activation: silu | gelu_tanh
    qk_norm: bool = False  # RMSNorm over each head's query and key before rotary (qwen3, gemma3)
    sandwich: bool = False  # a norm after attention and after the MLP too, before each residual add (gemma2/3)
    embed_scale: bool = False  # embeddings times sqrt(hidden) (gemma)
    norm: str = "rms"  # rms | layer (LayerNorm with a bias: falcon)
    parallel: bool = False  # attention and the MLP both read the layer's input, their outputs added together (falcon)
    gated: bool = True  # the MLP is act(gate) * up; else act(up) (falcon)
    gguf_only: bool = False  # run from a GGUF's tensors only (a transformers folder of it keeps transformers' layers)
    # the default KV cache next to quantized weights on CPU is int8 (each head's vector in 127 steps of its own
    # scale); a family whose keys carry outlier channels keeps float16 instead (Qwen2.5's k biases: Qwen2.5-Coder
    # 1.5B Q4_K_M's perplexity 1.9 % below llama-perplexity's with int8 keys, 0.2 % with float32 ones)
    kv_int8: bool = True
    # transformers' tensor names, per layer (after "model.layers.N.") and for the fused forms (phi3)
    names: dict = field(
        default_factory=lambda: dict(
            attn_norm="input_layernorm",
            mlp_norm="post_attention_layernorm",
            post_attn_norm=None,
            post_mlp_norm=None,
            q_norm="self_attn.q_norm",
            k_norm="self_attn.k_norm",
            qkv=None,
            gate_up=None,
        )
    )


def _names(**over) -> dict:
    return {**Family().names, **over}


_LLAMA = Family()
_GEMMA_NAMES = _names(
    post_attn_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
)

FAMILIES: dict[str, Family] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": Family(kv_int8=False),  # q/k/v biases: taken where the weights have them
    "qwen3": Family(qk_norm=True),
    "phi3": Family(names=_names(qkv="self_attn.qkv_proj", gate_up="mlp.gate_up_proj")),
    "gemma": Family(norm_offset=1.0, activation="gelu_tanh", embed_scale=True),
    "gemma2": Family(norm_offset=1.0, activation="gelu_tanh", embed_scale=True, sandwich=True, names=_GEMMA_NAMES),
    "falcon": Family(activation="gelu_tanh", norm="layer", parallel=True, gated=False, gguf_only=True),
    "gemma3_text": Family(
        norm_offset=1.0, activation="gelu_tanh", embed_scale=True, sandwich=True, qk_norm=True, names=_GEMMA_NAMES
    ),
}

_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu": "gelu_tanh",
}  # gemma's and falcon's configs say "gelu" where llama.cpp computes tanh's


def supported(arch: str, cfg: dict | None = None, gguf: bool = True) -> bool:
    """Whether the compact decoder runs this architecture (cfg: config.json's fields, checked where given; gguf:
    from a GGUF's tensors, else from a transformers folder)."""
    if arch not in FAMILIES or (FAMILIES[arch].gguf_only and not gguf):
        return False
    if cfg is None:
        return True
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // max(1, cfg.get("num_attention_heads", 1))
    return act in _ACTIVATIONS and not cfg.get("mlp_bias") and head_dim % 2 == 0


@dataclass(frozen=True)
class ModelSpec:
    """One model, as the compact decoder runs it."""

    arch: str
    family: Family
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    activation: str
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    windows: tuple[int | None, ...]  # per layer: the sliding window (keys within the last N positions), None: all
    rope: tuple[int, ...]  # per layer: which of ropes
    ropes: tuple[object, ...]  # the configs the rotary tables are computed from (one per distinct base/scaling)
    rot_dim: int  # the leading dims of each head that rotary turns (partial rotary: fewer than head_dim)

    @property
    def plain(self) -> bool:
        """A llama-shaped model: what the fused decode kernels (rope_store, decode_attention, Decoder) run."""
        f = self.family
        return (
            self.activation == "silu"
            and not (f.qk_norm or f.sandwich or f.embed_scale or f.norm_offset)
            and f.norm == "rms"
            and not f.parallel
            and f.gated
            and self.attn_softcap is None
            and self.final_softcap is None
            and set(self.windows) == {None}
            and len(self.ropes) == 1
            and self.rot_dim == self.head_dim
            and math.isclose(self.attn_scale, self.head_dim**-0.5)
        )


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: the layer reads the whole context) from a transformers config (or any
    object with its attributes: pre-flight reads config.json's)."""
    arch, layers = config.model_type, config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if window and getattr(config, "use_sliding_window", True) and arch in ("mistral", "gemma2"):
        return tuple(window if arch == "mistral" or i % 2 == 0 else None for i in range(layers))
    return (None,) * layers


def describe(config) -> ModelSpec:
    """The ModelSpec of a transformers config of a supported architecture."""
    arch = config.model_type
    family = FAMILIES[arch]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    windows = layer_windows(config)
    ropes, rope = [config], [0] * config.num_hidden_layers
    local_base = getattr(config, "rope_local_base_freq", None)
    if local_base is not None and any(windows):  # gemma3: sliding layers turn by their own base, unscaled
        local = copy.copy(config)
        local.rope_theta, local.rope_scaling = local_base, None
        ropes.append(local)
        rope = [1 if w else 0 for w in windows]
    scalar = getattr(config, "query_pre_attn_scalar", None)
    act = (
        getattr(config, "hidden_activation", None)
        or getattr(config, "hidden_act", None)
        or getattr(config, "activation", None)
        or "silu"
    )
    return ModelSpec(
        arch=arch,
        family=family,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        eps=getattr(config, "rms_norm_eps", None) or config.layer_norm_epsilon,
        activation=_ACTIVATIONS[act],
        attn_scale=1.0 / math.sqrt(scalar if scalar else head_dim),  # as the kernels compute 1 / sqrt(D)
        attn_softcap=getattr(config, "attn_logit_softcapping", None) or None,
        final_softcap=getattr(config, "final_logit_softcapping", None) or None,
        windows=windows,
        rope=tuple(rope),
        ropes=tuple(ropes),
        rot_dim=int(head_dim * getattr(config, "partial_rotary_factor", 1.0)),
    )
