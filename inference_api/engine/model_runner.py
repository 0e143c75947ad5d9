"""Runs a causal LM over the row KV cache: chunked prefill of several rows, decode of many.

llama-family models run as a CompactLM (llama.py); every other architecture runs transformers' own
modules with their linears swapped for the ones linear.py picked. Both take the same call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import llama
from .attention import use_row_attention
from .kv_cache import RowKVCache
from .linear import linear_factory, use_linears


@dataclass(frozen=True)
class Precision:
    """How the weights and the cache are held: quantize is none, int8 or int4; group is the int8 scale
    group (None: one scale per output channel; 32 for GGUF's Q8_0 blocks); batch_dtype is the dtype of a
    oneDNN copy the CPU's quantized layers run several rows on (None: no copy, the kernels run them);
    int8_inputs: the CPU kernels round up to 16 rows' inputs to int8 blocks (as llama.cpp does) instead of
    reading them in float32."""

    quantize: str = "none"
    kv_dtype: torch.dtype | None = None  # None: the model's dtype
    group: int | None = None
    batch_dtype: torch.dtype | None = None
    int8_inputs: bool = False


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) from a transformers config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


class _HFModel:
    """transformers' modules behind the CompactLM call."""

    def __init__(self, model):
        self.model = model

    def forward(self, ids, positions, visible, cache, last_only=True):
        mask = torch.zeros(visible.shape, dtype=self.model.dtype, device=ids.device)
        mask.masked_fill_(~visible, torch.finfo(self.model.dtype).min)  # additive: sdpa and eager alike
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask[:, None],
                         past_key_values=cache, cache_position=positions[0], use_cache=True,
                         logits_to_keep=1 if last_only else 0)
        return out.logits.float()


def build_model(model, precision: Precision, kernels, length: int):
    """The callable model for the runner, and a word for the log on how it runs."""
    make_linear = linear_factory(model.device, model.dtype, precision.quantize, kernels, precision.batch_dtype,
                                 precision.int8_inputs)
    if llama.supports(model.config):
        def embed_fn(embed_w, head_w):
            head_mode = "int8" if precision.quantize != "none" else None
            head = make_linear(head_w, None, group=precision.group or 32, as_mode=head_mode)
            if head_w is embed_w and hasattr(head, "weight") and hasattr(head.weight, "rows"):
                return head.weight.rows, head  # a tied quantized head: embeddings read from its rows
            table = embed_w.detach().clone()
            return (lambda ids: F.embedding(ids, table)), head
        return llama.build_compact(model, make_linear, embed_fn, length, kernels), "compact"
    if model.device.type == "cpu" or precision.quantize != "none":
        use_linears(model, lambda w, b: make_linear(w, b, precision.group))
    use_row_attention(model)
    return _HFModel(model), "transformers"


class ModelRunner:
    def __init__(self, model, rows: int, context_length: int, precision: Precision = Precision(), kernels=None):
        self.device = model.device
        self.dtype = model.dtype
        self.vocab_size = model.config.vocab_size
        self.model, self.kind = build_model(model, precision, kernels, context_length + 1)
        kv_dtype = precision.kv_dtype if self.kind == "compact" and precision.kv_dtype else self.dtype
        layers, kv_heads, head_dim = kv_geometry(model.config)
        self.cache = RowKVCache(layers, rows, kv_heads, context_length, head_dim, kv_dtype, self.device)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        return self.model.forward(ids, positions, visible, self.cache)[:, -1]

    @torch.inference_mode()
    def prefill(self, rows: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Write each chunk at positions start.. of its row, all rows in one forward; return the logits of
        each chunk's last token [len(rows), V]. Chunks are left-padded so every row's last token is last;
        padding writes to the scratch slot and sees only position 0."""
        width = max(len(c) for c in chunks)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        write = torch.full((len(rows), width), self.cache.scratch, dtype=torch.long)
        for i, (chunk, start) in enumerate(zip(chunks, starts)):
            pad = width - len(chunk)
            ids[i, pad:] = torch.tensor(chunk)
            positions[i, pad:] = torch.arange(start, start + len(chunk))
            write[i, pad:] = positions[i, pad:]
        attend = max(s + len(c) for s, c in zip(starts, chunks))
        real = write != self.cache.scratch
        keys = torch.arange(attend)
        visible = torch.where(real[..., None], keys <= positions[..., None], keys == 0)  # [B, T, L]
        ids, positions, write, visible = (t.to(self.device) for t in (ids, positions, write, visible))
        self.cache.bind(torch.tensor(rows, device=self.device), write, attend)
        return self._forward(ids, positions, visible)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """One token for each of rows 0..B-1 at its position; inactive rows write to the scratch slot.

        Returns logits [B, V] (rows that are not active give garbage that the caller ignores).
        """
        b = tokens.shape[0]
        attend = int(positions[active].max()) + 1
        write = torch.where(active, positions, self.cache.scratch)[:, None]
        visible = torch.arange(attend, device=self.device)[None, :] <= torch.where(active, positions, 0)[:, None]
        self.cache.bind(slice(0, b), write, attend)
        return self._forward(tokens[:, None], write.clamp(max=attend - 1), visible[:, None])

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Give row dst the first length cached positions of row src (a prompt prefix found there)."""
        self.cache.copy_prefix(src, dst, length)
