"""Attention over the row KV cache on CPU: SDPA with grouped-query heads read in place.

transformers' own SDPA path copies every layer's keys and values to repeat them for each query head
whenever a mask is given (it always is here). On CPU, SDPA takes the mask and the grouped heads as they
are, which makes a decode step of 32 rows about a tenth faster. Results are identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "row_sdpa"


def row_sdpa(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def use_row_attention(model) -> None:
    """Switch a CPU model on transformers' SDPA to row_sdpa; other devices and attention kinds stay as
    they are (on CUDA a mask plus grouped heads would drop SDPA to its slow math kernel)."""
    if model.device.type != "cpu" or model.config._attn_implementation != "sdpa":
        return
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, row_sdpa)
    model.set_attn_implementation(NAME)
