"""A GGUF file read straight into the compact decoder, as llama.cpp reads it: its hyperparameters from the
file's metadata (with llama.cpp's defaults where the file is silent), its tensors by llama.cpp's names, one
at a time, so no float32 checkpoint is ever written or held whole.

``GGUFModel`` stands where a transformers model stands for the runner: ``config`` (a transformers config
built from the metadata, which families.describe reads), ``device``, ``dtype``, and the weights by role
(``weights()``) for compact.build_compact. Linear weights keep their own blocks (gguf_blocks); norms and
other float tensors are read as float32.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ..kernels.quant import BlockWeight, Int4Weight, Int8Weight, stack
from .families import GGUF_FAMILIES, gguf_windows
from .gguf_blocks import file_rows, packed
from .gguf_meta import GGUFIndex

log = logging.getLogger(__name__)

ROW_MAPPED = (Int8Weight, Int4Weight, BlockWeight)  # the packed forms whose rows map_rows rewrites


class GGUFModel:
    def __init__(
        self,
        path: Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        reader=None,
        int8_layout: frozenset[str] = frozenset(),
        config: ModelConfig | None = None,
    ):
        self.path = Path(path)
        self.int8_layout = int8_layout  # the block types served in the int8 layout (the plan's choice)
        # the weights need the header's numbers and the tensors, never the vocabulary: the light index, unless a
        # first start's full reader is at hand
        self.reader = reader if reader is not None else GGUFIndex(path)
        self.fields = self.reader.fields
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self._field("general.architecture")
        if self.arch not in GGUF_FAMILIES:
            raise ValueError(f"GGUF architecture {self.arch!r} is not one the compact decoder runs")
        self.family = GGUF_FAMILIES[self.arch]
        self.config = config if config is not None else gguf_config(self)
        self.device, self.dtype = torch.device(device), dtype

    def _field(self, key: str, default=None):
        f = self.fields.get(key)
        if f is None:
            return default
        return f.contents() if hasattr(f, "contents") else f  # gguf-py's ReaderField, or the index's value

    def hparam(self, key: str, default=None):
        return self._field(f"{self.arch}.{key}", default)

    def tensor(self, name: str) -> torch.Tensor | None:
        """A tensor dequantized to float32, rows first ([out, in] for a weight), or None if the file has none."""
        from gguf.quants import dequantize

        t = self.tensors.get(name)
        if t is None:
            return None
        data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(n) for n in reversed(t.shape))
        return torch.from_numpy(data.reshape(shape).copy())

    def _unpermute(self, w, heads: int):
        """convert_hf_to_gguf's permutation of q or k rows undone where the family's converter made it
        (``unpermute_rows``)."""
        if w is None or not self.family.permuted_qk:
            return w
        return unpermute_rows(w, heads)

    def weights(self) -> GGUFWeights:
        return GGUFWeights(self)


def unpermute_rows(w, heads: int):
    """convert_hf_to_gguf's permutation of q or k rows (per head: pairs interleaved) undone, on a tensor (a weight,
    a bias, or a LoRA adapter's B) or on each row-first tensor of packed blocks."""
    if isinstance(w, ROW_MAPPED):
        return w.map_rows(lambda t: unpermute_rows(t, heads))
    rest = w.shape[1:]
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


class GGUFWeights:
    """The weights by role for compact.build_compact, read one tensor at a time (llama.cpp's names; its norms
    already hold Gemma's 1 + w)."""

    def __init__(self, model: GGUFModel):
        self.m = model
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads

    def _whole(self, name: str):
        """A tensor's own blocks where the kernels take them as they are, else its float32 weight (None: absent).
        The token embedding of a large vocabulary then never exists in float32 (Gemma 3: 0.67 GB)."""
        t = self.m.tensors.get(name)
        return None if t is None else packed(t, self.m.int8_layout) or self.m.tensor(name)

    def embed(self):
        """The token embedding: the head's blocks where it is the head too (tied), else left in the file (only its
        rows are read: never a copy resident beside the weights)."""
        if "output.weight" in self.m.tensors:
            return self.file_rows()
        return self._whole("token_embd.weight")

    def file_rows(self):
        """The token embedding left in the file for its row lookups, tied or not (gguf_blocks.file_rows)."""
        return file_rows(self.m.tensors["token_embd.weight"])

    def head(self):
        """The output head, or None when it is the token embedding (tied)."""
        return self._whole("output.weight")

    def final_norm(self) -> torch.Tensor:
        norm = self.m.tensor("output_norm.weight")
        if norm is None:
            raise ValueError(f"{self.m.path}: no output_norm.weight")
        return norm

    def final_norm_bias(self) -> torch.Tensor | None:
        return self.m.tensor("output_norm.bias")

    def linear(self, names: list[str], heads: list[int | None]):
        """(weight, mode) of one linear fused from these tensors (rows stacked): each part in its own blocks
        (gguf_blocks; Q8_0 in the int8 layout where the plan says, as the tables are; parts of different types as
        pieces of one layer), or, when a part has a type served as
        float (F32, or one the kernels lack), the float32 weight served unquantized (mode none); q and k rows back
        in the half-split rotary's order."""
        tensors = [self.m.tensors[n] for n in names]
        blocks = [packed(t, self.m.int8_layout) for t in tensors]
        as_blocks = all(b is not None for b in blocks)
        if not as_blocks:
            odd = sorted({t.tensor_type.name for t, b in zip(tensors, blocks) if b is None} - {"F32"})
            if odd:
                log.warning(
                    "GGUF tensors %s of type %s are served dequantized to float32 (no kernel takes them "
                    "in their own blocks)",
                    ", ".join(names),
                    "/".join(odd),
                )
        if as_blocks:
            return stack([self.m._unpermute(b, h) if h else b for b, h in zip(blocks, heads)]), None
        parts: list[torch.Tensor] = []
        for t, h in zip(tensors, heads):
            w = self.m.tensor(t.name)
            if w is None:  # (t is one of the file's tensors)
                raise KeyError(t.name)
            parts.append(self.m._unpermute(w, h) if h else w)
        return (torch.cat(parts) if len(parts) > 1 else parts[0]), "none"

    def layer(self, i: int) -> dict[str, Any]:
        t = lambda name: self.m.tensor(f"blk.{i}.{name}")  # noqa: E731
        has = lambda name: f"blk.{i}.{name}" in self.m.tensors  # noqa: E731
        if has("attn_qkv.weight"):
            qkv, qkv_mode = self.linear([f"blk.{i}.attn_qkv.weight"], [None])
            qkv_bias = t("attn_qkv.bias")
        else:  # q, k and v apart: q and k back to the half-split rotary's order, then fused
            qkv, qkv_mode = self.linear([f"blk.{i}.attn_{n}.weight" for n in "qkv"], [self.heads, self.kv_heads, None])
            biases = [
                self.m._unpermute(t("attn_q.bias"), self.heads),
                self.m._unpermute(t("attn_k.bias"), self.kv_heads),
                t("attn_v.bias"),
            ]
            qkv_bias = None if any(b is None for b in biases) else torch.cat(biases)
        # phi3 and falcon: ffn_up alone (phi3's holds [gate | up])
        gate_up, gate_up_mode = self.linear(
            [f"blk.{i}.ffn_{n}.weight" for n in ("gate", "up") if has(f"ffn_{n}.weight")], [None, None]
        )
        o, o_mode = self.linear([f"blk.{i}.attn_output.weight"], [None])
        down, down_mode = self.linear([f"blk.{i}.ffn_down.weight"], [None])
        norms = dict(
            attn_norm=t("attn_norm.weight"),
            attn_norm_b=t("attn_norm.bias"),
            mlp_norm=t("ffn_norm.weight"),
            mlp_norm_b=t("ffn_norm.bias"),
        )
        if self.m.family.parallel:  # one LayerNorm for both (falcon 7B), or attention's own norm_2 (40B)
            first = norms["attn_norm"], norms["attn_norm_b"]
            second = t("attn_norm_2.weight"), t("attn_norm_2.bias")
            norms = dict(
                attn_norm=second[0] if second[0] is not None else first[0],
                attn_norm_b=second[1] if second[0] is not None else first[1],
                mlp_norm=first[0],
                mlp_norm_b=first[1],
            )
            if second[0] is None:
                norms["mlp_norm"], norms["mlp_norm_b"] = norms["attn_norm"], norms["attn_norm_b"]
        return dict(
            **norms,
            qkv=qkv,
            qkv_bias=qkv_bias,
            o=o,
            o_bias=t("attn_output.bias"),
            gate_up=gate_up,
            down=down,
            modes=dict(qkv=qkv_mode, o=o_mode, gate_up=gate_up_mode, down=down_mode),
            q_norm=t("attn_q_norm.weight"),
            k_norm=t("attn_k_norm.weight"),
            post_attn_norm=t("post_attention_norm.weight"),
            post_mlp_norm=t("post_ffw_norm.weight"),
        )

    def drop_layer(self, i: int) -> None:
        """Nothing held: each tensor is read when asked for. The file's pages read so far leave the process's
        resident set (they stay in the system's page cache): without it a load's resident peak counts the whole
        mapped file beside the weights made of it (Qwen2.5 1.5B IQ3_S: 3.4 GB at the last layer, 2.5 after)."""
        release = getattr(self.m.reader, "release_pages", None)  # (GGUFIndex's; a first start's GGUFReader has none)
        if release is not None:
            release()


class ModelConfig(SimpleNamespace):
    """A converted GGUF's config as its folder holds it (loader.COMPACT_CONFIG: what gguf_config gave at the
    conversion, every field of the family's transformers config class), read without transformers: the engine
    process of a GGUF never imports it (about 0.06 GB)."""

    @classmethod
    def read(cls, folder: Path | str | None) -> ModelConfig | None:
        """The folder's compact config, or None where it has none (a folder converted with weights, or none)."""
        from .loader import COMPACT_CONFIG

        if folder is None or not (path := Path(folder) / COMPACT_CONFIG).is_file():
            return None
        return cls(**json.loads(path.read_text()))


def gguf_config(m: GGUFModel):
    """A transformers config for the file's metadata, as llama.cpp's load_hparams reads it."""
    from transformers import AutoConfig

    arch = m.arch
    embd = m.tensors["token_embd.weight"]
    hidden = int(m.hparam("embedding_length"))
    heads = int(m.hparam("attention.head_count"))
    head_dim = int(m.hparam("attention.key_length") or hidden // heads)
    layers = int(m.hparam("block_count"))
    kw: dict[str, Any] = dict(  # AutoConfig.for_model's arguments
        vocab_size=int(embd.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(m.hparam("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(m.hparam("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(m.hparam("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(m.hparam("rope.freq_base", 10000.0)),
        max_position_embeddings=int(m.hparam("context_length", 4096)),
        tie_word_embeddings="output.weight" not in m.tensors,
    )
    rot = m.hparam("rope.dimension_count")
    if rot and int(rot) != head_dim:
        kw["partial_rotary_factor"] = int(rot) / head_dim
    if m.hparam("rope.scaling.type") == "linear" and m.hparam("rope.scaling.factor"):
        kw["rope_scaling"] = {"rope_type": "linear", "factor": float(m.hparam("rope.scaling.factor"))}
    windows = gguf_windows(
        arch, layers, m.hparam("attention.sliding_window"), m.hparam("attention.sliding_window_pattern")
    )
    if m.family.swa_pattern is not None:
        kw["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows]
        if any(windows):
            kw["sliding_window"] = next(w for w in windows if w)
    args = m.family.gguf_config(m, kw) if m.family.gguf_config else kw
    config = AutoConfig.for_model(m.family.model_type, **args)
    for key in ("num_key_value_heads", "head_dim"):  # what the decoder reads, whatever the config class calls it
        if getattr(config, key, None) != kw[key]:
            setattr(config, key, kw[key])
    factors = m.tensor("rope_freqs.weight")  # Llama 3's rope scaling, as llama.cpp applies it: per-frequency divisors
    if factors is not None:
        config.rope_freq_factors = [float(f) for f in factors]
    long, short = m.tensor("rope_factors_long.weight"), m.tensor("rope_factors_short.weight")
    if long is not None and short is not None:  # Phi-3's LongRoPE: the long divisors past the original context
        config.rope_factors_long, config.rope_factors_short = [float(f) for f in long], [float(f) for f in short]
        config.rope_original_context = int(
            m.hparam("rope.scaling.original_context_length") or m.hparam("context_length")
        )
    attn_factor = m.hparam("rope.scaling.attn_factor")
    if attn_factor:
        config.rope_attn_factor = float(attn_factor)  # cos and sin scaled by it, as llama.cpp's mscale
    return config
