"""The tiny random llama the tests build in-process (no download): 8 attention heads and 4 key/value heads of 16
dims, so its heads divide by 2 and by 4, in 2 layers."""

from __future__ import annotations


def tiny_llama_config(vocab_size: int):
    import transformers as T

    return T.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=256,
        initializer_range=0.2,
    )
