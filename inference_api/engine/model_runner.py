"""Runs a transformers causal LM over the row KV cache: chunked prefill of one row, decode of many."""
from __future__ import annotations

import torch

from .kv_cache import RowKVCache


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) from a transformers config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


class ModelRunner:
    def __init__(self, model, rows: int, context_length: int):
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self.vocab_size = model.config.vocab_size
        layers, kv_heads, head_dim = kv_geometry(model.config)
        self.cache = RowKVCache(layers, rows, kv_heads, context_length, head_dim, self.dtype, self.device)
        self._neg = torch.finfo(self.dtype).min

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, logits_to_keep: int):
        # additive mask [B, 1, T, L]: works for the sdpa and eager attention paths alike
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, self._neg)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask[:, None],
                         past_key_values=self.cache, cache_position=positions[0], use_cache=True,
                         logits_to_keep=logits_to_keep)
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def prefill(self, row: int, token_ids: list[int], start: int) -> torch.Tensor:
        """Write token_ids at positions start.. of one row; return the last position's logits [V]."""
        end = start + len(token_ids)
        positions = torch.arange(start, end, device=self.device)[None]
        visible = torch.arange(end, device=self.device)[None, :] <= positions[0][:, None]  # causal [T, L]
        self.cache.bind(slice(row, row + 1), positions, end)
        ids = torch.tensor([token_ids], device=self.device)
        return self._forward(ids, positions, visible[None], 1)[0]

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
        return self._forward(tokens[:, None], write.clamp(max=attend - 1), visible[:, None], 1)
