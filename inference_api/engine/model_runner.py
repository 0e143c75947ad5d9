"""Runs a transformers causal LM over the row KV cache: chunked prefill of one row, decode of many."""
from __future__ import annotations

import torch

from .attention import use_row_attention
from .kv_cache import RowKVCache
from .linear import use_packed_linears


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) from a transformers config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


class ModelRunner:
    def __init__(self, model, rows: int, context_length: int):
        self.device = model.device
        self.dtype = model.dtype
        use_row_attention(model)
        self.packed_linears = use_packed_linears(model)
        self.model = model
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
        return self._forward(ids, positions, visible, 1)

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
