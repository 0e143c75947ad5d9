"""The tiny random models the tests build in-process (no download): one config builder for every family, the
folder they are saved in with the real tokenizer, and the engine's greedy tokens for a few prompts."""

from __future__ import annotations

from pathlib import Path

VOCAB = 49152  # the SmolLM2 tokenizer's, shared by every tiny model saved with it
PROMPTS = ["Hello there, how are", "The quick brown fox jumps over the lazy dog and then it", "One"]

# the families whose configs name the sizes otherwise than llama's
_KEYS = {
    "gpt2": {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "intermediate_size": "n_inner",
    },
    "opt": {"intermediate_size": "ffn_dim", "initializer_range": "init_std"},
}


def tiny_config(
    model_type: str = "llama",
    vocab_size: int = VOCAB,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    intermediate_size: int | None = 128,
    initializer_range: float | None = 0.2,
    **extra,
):
    """A transformers config of the family at these sizes, under the family's own names (None: its default),
    and ``extra`` (key/value heads, head_dim, windows, ...) as given."""
    import transformers as T

    sizes = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate_size,
        "initializer_range": initializer_range,
    }
    keys = _KEYS.get(model_type, {})
    return T.AutoConfig.for_model(model_type, **{keys.get(k, k): v for k, v in sizes.items() if v is not None}, **extra)


def tiny_llama_config(vocab_size: int = VOCAB):
    """The llama split over ranks: 8 attention heads and 4 key/value heads of 16 dims, so its heads divide by 2
    and by 4, in 2 layers."""
    return tiny_config("llama", vocab_size, hidden_size=128, heads=8, intermediate_size=256, num_key_value_heads=4)


def small_llama_config(**extra):
    """The llama of the attention and linear-layer tests: 64 tokens, 6 attention heads and 2 key/value heads of 8
    dims, transformers' own initialization."""
    return tiny_config(
        "llama",
        64,
        hidden_size=48,
        heads=6,
        intermediate_size=96,
        initializer_range=None,
        num_key_value_heads=2,
        **extra,
    )


def save_tiny_model(config, folder: Path, tokenizer_dir: Path) -> Path:
    """A random model of the config (seed 0) with the real tokenizer (its end token the model's), saved as a
    local folder."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config)
    tokenizer = T.AutoTokenizer.from_pretrained(tokenizer_dir)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def tiny_engine(folder: Path, context_length: int = 256, **config):
    """(engine, ready) of 4 rows on the saved model, prompts prefilled in chunks of 8 (the long prompt in
    several); ``config``: ServerConfig's other fields."""
    from inference_api.config import ServerConfig
    from inference_api.engine.process import build_engine

    return build_engine(
        ServerConfig(model=str(folder), rows=4, context_length=context_length, prefill_chunk=8, **config)
    )


def engine_greedy(engine, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's ``max_tokens`` greedy tokens (no end token), the prompts added to the engine together and
    stepped until it has no work."""
    from inference_api.engine.messages import GenerateRequest, SamplingParams

    for i, ids in enumerate(prompt_ids):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add(GenerateRequest(str(i), tuple(ids), params))
    out: list[list[int]] = [[] for _ in prompt_ids]
    while engine.has_work:
        for event in engine.step():
            assert event.error is None, event.error
            out[int(event.session_id)].extend(event.token_ids)
    return out
