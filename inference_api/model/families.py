"""The architectures the compact decoder runs, each described once (as llama.cpp's per-architecture tables and
vLLM's model registry do). A ``Family`` entry is every fact about a family that the code reads: its names
(transformers' model_type, llama.cpp's architecture), what it computes differently (norms, activation, q/k norms,
embedding scale, a parallel block), its transformers tensor names, and how its GGUF files say the rest (the
sliding-window pattern llama.cpp assumes, q/k rows permuted by the converter, the config keys only this family
reads from the file's metadata). The GGUF reader (gguf_meta, gguf_model), the loader, the plan, pre-flight and
scripts/make_reference_ggufs.py read this table; adding a family is one entry here and its tests (CONTRIBUTING.md).

``describe`` reads one model's numbers from its transformers config (attention scale, soft-capping, each layer's
sliding window and rotary base). compact.py runs any described family through the same layers; everything else
runs on transformers' own modules (the fallback).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    model_type: str  # transformers' model_type, the key of FAMILIES
    gguf: str | None = None  # llama.cpp's general.architecture (None: llama.cpp writes this family as another)
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + weight): Gemma's norms store weight - 1
    activation: str = "silu"  # the gated MLP's activation: silu | gelu_tanh
    qk_norm: bool = False  # RMSNorm over each head's query and key before rotary (qwen3, gemma3)
    sandwich: bool = False  # a norm after attention and after the MLP too, before each residual add (gemma2/3)
    embed_scale: bool = False  # embeddings times sqrt(hidden) (gemma)
    norm: str = "rms"  # rms | layer (LayerNorm with a bias: falcon)
    parallel: bool = False  # attention and the MLP both read the layer's input, their outputs added together (falcon)
    gated: bool = True  # the MLP is act(gate) * up; else act(up) (falcon)
    gguf_only: bool = False  # run from a GGUF's tensors only (a transformers folder of it keeps transformers' layers)
    # the sliding-window layers where neither a config's layer_types nor a GGUF's per-layer key says: llama.cpp's
    # pattern n (layer i slides unless i % n == n - 1; 0: every layer slides); None: no layer slides
    swa_pattern: int | None = None
    # convert_hf_to_gguf permuted q and k rows for llama.cpp's adjacent-pair rotary (rope type NORM); the reader
    # permutes them back for the half-split rotary the decoder runs
    permuted_qk: bool = False
    # the transformers config keys only this family reads from a GGUF: (the file, the common keys) -> the keys
    # AutoConfig.for_model takes (gguf_model.gguf_config builds the common ones; the file: its hparam(key, default)
    # by llama.cpp's key after "<arch>.", and its tensors by name)
    gguf_config: Callable[[Any, dict], dict] | None = None
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
    return {**Family("").names, **over}


_GEMMA_NAMES = _names(
    post_attn_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
)


def _gemma_gguf(gguf, kw: dict) -> dict:
    # llama.cpp's attention scale: 1 / sqrt(head_dim), but for the 27B models (46 or 62 layers) 1 / sqrt(hidden /
    # heads)
    wide = kw["num_hidden_layers"] in (46, 62)
    scalar = kw["hidden_size"] // kw["num_attention_heads"] if wide else kw["head_dim"]
    return {**kw, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar}


def _gemma2_gguf(gguf, kw: dict) -> dict:
    caps = {k: gguf.hparam(k) for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return {**_gemma_gguf(gguf, kw), **caps}


def _gemma3_gguf(gguf, kw: dict) -> dict:
    local = float(gguf.hparam("rope.freq_base_swa", 10000.0))  # the sliding layers' own rotary base
    return {
        **_gemma_gguf(gguf, kw),
        "rope_local_base_freq": local,
        "final_logit_softcapping": gguf.hparam("final_logit_softcapping"),
    }


def _falcon_gguf(gguf, kw: dict) -> dict:
    # 7B: one LayerNorm, multi-query; 40B ("new decoder architecture"): attention's own norm_2, grouped KV
    common = {k: v for k, v in kw.items() if k not in ("rms_norm_eps", "head_dim", "intermediate_size")}
    return {
        **common,
        "layer_norm_epsilon": float(gguf.hparam("attention.layer_norm_epsilon", 1e-5)),
        "num_kv_heads": kw["num_key_value_heads"],
        "activation": "gelu",
        "alibi": False,
        "new_decoder_architecture": "blk.0.attn_norm_2.weight" in gguf.tensors,
        "parallel_attn": True,
        "multi_query": kw["num_key_value_heads"] == 1,
        "bias": False,
        "ffn_hidden_size": kw["intermediate_size"],
    }


def _family(model_type: str, **facts: Any) -> tuple[str, Family]:
    return model_type, Family(model_type=model_type, **facts)


_GEMMA = dict(norm_offset=1.0, activation="gelu_tanh", embed_scale=True)

FAMILIES: dict[str, Family] = dict(
    [
        _family("llama", gguf="llama", permuted_qk=True),
        _family("mistral", permuted_qk=True, swa_pattern=0),  # llama.cpp writes Mistral's files as "llama"
        # q/k/v biases, taken where the weights have them (the layers whose key biases make outlier channels keep
        # float16 in the int8 KV cache: gguf_meta.key_outliers)
        _family("qwen2", gguf="qwen2", gguf_config=lambda gguf, kw: {**kw, "use_sliding_window": False}),
        _family("qwen3", gguf="qwen3", qk_norm=True),
        _family("phi3", gguf="phi3", names=_names(qkv="self_attn.qkv_proj", gate_up="mlp.gate_up_proj")),
        _family("gemma", gguf="gemma", gguf_config=_gemma_gguf, **_GEMMA),
        _family(
            "gemma2",
            gguf="gemma2",
            sandwich=True,
            names=_GEMMA_NAMES,
            swa_pattern=2,
            gguf_config=_gemma2_gguf,
            **_GEMMA,
        ),
        _family(
            "gemma3_text",
            gguf="gemma3",
            sandwich=True,
            qk_norm=True,
            names=_GEMMA_NAMES,
            swa_pattern=6,
            gguf_config=_gemma3_gguf,
            **_GEMMA,
        ),
        _family(
            "falcon",
            gguf="falcon",
            activation="gelu_tanh",
            norm="layer",
            parallel=True,
            gated=False,
            gguf_only=True,
            gguf_config=_falcon_gguf,
        ),
    ]
)
# llama.cpp's architecture names -> their families (the GGUF files the compact decoder reads)
GGUF_FAMILIES: dict[str, Family] = {f.gguf: f for f in FAMILIES.values() if f.gguf is not None}


@dataclass(frozen=True)
class EncoderArch:
    """One GGUF encoder family (an embedding model, model/encoder.py): what llama.cpp's bert graph does differently
    for it (src/models/bert.cpp)."""

    rope: bool  # positions by NEOX rotary on q and k (``<arch>.rope.freq_base``), not a learned position_embd
    gated: bool  # the MLP is SwiGLU (silu(ffn_gate) * ffn_up), not GELU(ffn_up)


# the GGUF encoder architectures model/encoder.py runs (here, with the decoders' table, so that pre-flight, the plan
# and the loader read them without importing torch)
ENCODERS = {"bert": EncoderArch(rope=False, gated=False), "nomic-bert": EncoderArch(rope=True, gated=True)}


def model_type(gguf_arch: str) -> str:
    """transformers' model_type for a llama.cpp architecture name (the name itself where no family says otherwise)."""
    family = GGUF_FAMILIES.get(gguf_arch)
    return family.model_type if family is not None else gguf_arch


def gguf_windows(gguf_arch: str, layers: int, window, pattern=None) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: the layer reads the whole context) from a GGUF's
    ``attention.sliding_window`` and ``attention.sliding_window_pattern`` (the family's llama.cpp pattern when the
    file has none)."""
    family = GGUF_FAMILIES.get(gguf_arch)
    if family is None or family.swa_pattern is None:  # a family without sliding layers
        return (None,) * layers
    return _windows(layers, window, family.swa_pattern if pattern is None else pattern)


def _windows(layers: int, window, pattern: int | None) -> tuple[int | None, ...]:
    if pattern is None or not window:
        return (None,) * layers
    n = int(pattern)
    return tuple(int(window) if n == 0 or i % n < n - 1 else None for i in range(layers))


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
    def fused(self) -> bool:
        """Whether the kernels' Decoder (csrc/decoder.cpp) runs this model's decode step: RMSNorm, a gated MLP of
        SiLU or GELU, the layer's parts one after the other, and a rotary over whole heads. Per-head and output
        norms, soft-capping, sliding windows and a second rotary table are the Decoder's per-layer inputs."""
        f = self.family
        return (
            self.activation in ("silu", "gelu_tanh")
            and f.norm == "rms"
            and not f.parallel
            and f.gated
            and self.rot_dim == self.head_dim
        )


def config_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: the layer reads the whole context) from a transformers config (or any
    object with its attributes: pre-flight reads config.json's)."""
    layers, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types)
    family = FAMILIES.get(config.model_type)
    if family is None or not getattr(config, "use_sliding_window", True):
        return (None,) * layers
    return _windows(layers, window, family.swa_pattern)


def describe(config) -> ModelSpec:
    """The ModelSpec of a transformers config of a supported architecture."""
    arch = config.model_type
    family = FAMILIES[arch]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    windows = config_windows(config)
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
