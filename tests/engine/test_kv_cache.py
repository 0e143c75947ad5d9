"""An int8 KV cache that keeps some layers in float16 (``RowKVCache(float_layers=...)``, the plan's
``kv_float_layers``: the layers whose keys carry outlier channels). The tiny Qwen2 file from tests/data/gguf, served
as the server serves it (int8 cache, int8 inputs), its cache swapped for caches of the same geometry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from servers import MODEL_CACHE, ROOT

from inference_api.config import ServerConfig
from inference_api.engine.kv_cache import RowKVCache
from inference_api.engine.process import build_engine

QWEN2 = ROOT / "tests" / "data" / "gguf" / "qwen2-q4_k_m.gguf"


@pytest.fixture(scope="module")
def runner():
    config = ServerConfig(model=str(QWEN2), model_cache_dir=Path(MODEL_CACHE), rows=3, context_length=128)
    return build_engine(config)[0].runner


def like(cache: RowKVCache, dtype: torch.dtype, float_layers=()) -> RowKVCache:
    rows, heads, _, dim = cache.keys[0].shape
    return RowKVCache(len(cache.keys), rows, heads, cache.length, dim, dtype, "cpu", float_layers=float_layers)


def scored(runner, cache: RowKVCache, ids: list[int]) -> torch.Tensor:
    kept = runner.cache
    try:
        runner.cache = cache
        return runner.score(0, ids)
    finally:
        runner.cache = kept


def test_the_float16_layers_of_an_int8_cache_read_as_a_float16_cache(runner):
    """Every layer named: the numbers of a float16 cache, to the bit; one layer named: its keys and values
    stored in float16 (no scales: an empty [rows, heads, 0]), the others in int8, numbers between the two."""
    assert runner.plan.kv_dtype == "int8" and runner.plan.kv_float_layers == ()  # (its random biases: no outliers)
    layers = len(runner.cache.keys)
    ids = [(i * 29 + 7) % 300 + 4 for i in range(60)]
    half = scored(runner, like(runner.cache, torch.float16), ids)
    named = like(runner.cache, torch.int8, float_layers=range(layers))
    assert torch.equal(scored(runner, named, ids), half)
    mixed = like(runner.cache, torch.int8, float_layers=(0,))
    assert mixed.layer_dtypes == [torch.float16] + [torch.int8] * (layers - 1)
    assert mixed.key_scales[0].shape[2] == 0 and mixed.key_scales[1].shape[2] == 129
    assert mixed.scales(0) == (None, None) and mixed.scales(1)[0] is mixed.key_scales[1]
    both = scored(runner, mixed, ids)
    int8 = scored(runner, like(runner.cache, torch.int8), ids)
    assert not torch.equal(both, int8) and not torch.equal(both, half)
    assert mixed.keys[0][0, :, :60].abs().sum() > 0 and mixed.key_scales[1][0, :, :60].abs().sum() > 0


def test_a_mixed_cache_copies_snapshots_and_restores_every_layer(runner):
    """The prefix cache's copy between rows and the prompt cache's snapshot and restore carry the float16
    layers and the int8 ones (with their scales): a row restored or copied scores its next tokens as the row it
    came from."""
    cache = like(runner.cache, torch.int8, float_layers=(1,))
    ids = [(i * 17 + 3) % 250 + 4 for i in range(40)]
    kept = runner.cache
    try:
        runner.cache = cache
        runner.prefill([0], [ids[:30]], [0])
        want = runner.decode([0], [ids[30]], [30])
        cache.copy_prefix(0, 1, 30)
        assert torch.equal(runner.decode([1], [ids[30]], [30]), want)
        saved = cache.snapshot(0, 30)
        assert [t.dtype for t in saved[: 2 * len(cache.keys)]] == cache.layer_dtypes * 2
        cache.restore(2, saved)
        assert torch.equal(runner.decode([2], [ids[30]], [30]), want)
    finally:
        runner.cache = kept
