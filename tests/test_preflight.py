"""Pre-flight arithmetic and decisions, without loading any weights."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from inference_api.config import ServerConfig
from inference_api.model_loader import precision_names, quantize_mode, vnni_tiles
from inference_api.preflight import (GiB, PreflightError, bytes_per_kv, bytes_per_weight, estimate_bytes, preflight,
                                     safetensors_params, shape_from_config)
from servers import MODEL_CACHE

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}


def test_estimate_bytes_is_weights_plus_keys_and_values_for_every_row_and_position():
    weights, kv = estimate_bytes(1000, 0.5, 2, num_layers=2, num_kv_heads=3, head_dim=4, rows=5, context_length=9)
    assert weights == 500
    # an untied embedding dense, the head in int8 groups of 32, the rest at 0.5
    assert estimate_bytes(1000, 0.5, 2, 2, 3, 4, 5, 9, dense_params=100, bytes_per_dense=4, head_params=100,
                          bytes_per_head=1.25)[0] == 800 * 0.5 + 100 * 4 + 100 * 1.25
    assert kv == 2 * 2 * 5 * 3 * (9 + 1) * 4 * 2  # keys and values, layers, rows, heads, positions (+scratch)


def test_the_parameter_count_from_the_config_matches_the_weights(model_dir):
    assert shape_from_config(SMOLLM2).num_params == safetensors_params(model_dir) == 134_515_008


def test_bytes_follow_dtype_quantization_and_kv_dtype():
    c = ServerConfig()
    assert bytes_per_weight(c, "cpu") == 4 and bytes_per_weight(c, "cuda") == 2
    # engine/quant.py's layouts: int4 half a byte plus float16 scale and minimum per 32; int8 a byte plus a
    # float32 scale per 32 (GGUF) or per output channel of K inputs (folder); on CPU also the bfloat16 copy
    # that oneDNN runs several rows on (linear.SplitLinear) where the CPU multiplies bfloat16 and --dtype is
    # auto; and the weights packed for the VNNI tiles where the CPU has AVX512-VNNI
    copy = (2 if precision_names(c, "cpu", "int4")[1] else 0) + (0.5 + 4 / 32 if vnni_tiles(c, "cpu", "int4") else 0)
    exact = ServerConfig(dtype="float32")
    assert bytes_per_weight(c, "cuda", "int4") == 0.5 + 4 / 32 and bytes_per_weight(c, "cuda", "int8") == 1 + 4 / 32
    assert bytes_per_weight(c, "cpu", "int4") == 0.5 + 4 / 32 + copy
    assert bytes_per_weight(exact, "cpu", "int4") == 0.5 + 4 / 32
    assert bytes_per_weight(exact, "cpu", "int8") == 1 + 4 / 32
    assert bytes_per_weight(exact, "cpu", "int8", in_features=576) == 1 + 4 / 576
    assert bytes_per_kv(ServerConfig(kv_dtype="bfloat16"), "cpu") == 2
    assert bytes_per_kv(ServerConfig(dtype="float16"), "cpu") == 2
    # int8 next to quantized weights on CPU: a byte per value and a float16 scale per head vector
    assert bytes_per_kv(c, "cpu", "int4", head_dim=64) == 1 + 2 / 64 and bytes_per_kv(c, "cpu") == 4
    assert bytes_per_kv(c, "cuda", "int4") == 2  # the model's dtype on CUDA
    assert quantize_mode(ServerConfig(quantize="int8")) == "int8"
    assert quantize_mode(ServerConfig(model="some/folder")) == "none"


def test_too_large_refuses_unless_skipped(model_dir):
    huge = ServerConfig(model_cache_dir=Path(MODEL_CACHE), context_length=10**8)
    with pytest.raises(PreflightError, match="--context-length"):
        preflight(huge)
    est = preflight(ServerConfig(model_cache_dir=Path(MODEL_CACHE), context_length=10**8, skip_preflight=True))
    assert est.kv_cache_bytes > 1000 * GiB
    dense = preflight(ServerConfig(model_cache_dir=Path(MODEL_CACHE), quantize="none", skip_preflight=True))
    assert dense.weights_bytes == 4 * 134_515_008 and dense.disk_needed_bytes == 0
    default = preflight(ServerConfig(model_cache_dir=Path(MODEL_CACHE), skip_preflight=True))  # the GGUF's 4-bit
    head = 49152 * 576  # tied: the int8 head's rows are the embeddings; each has its bfloat16 copy where used
    c = ServerConfig()
    bf16 = 2 if precision_names(c, "cpu", "int4")[1] else 0
    vnni4, vnni8 = (0.5 + 4 / 32, 1 + 8 / 32) if vnni_tiles(c, "cpu", "int4") else (0, 0)
    assert default.weights_bytes == math.ceil((134_515_008 - head) * (0.5 + 4 / 32 + bf16 + vnni4)
                                              + head * (1 + 4 / 32 + bf16 + vnni8))
    assert default.kv_cache_bytes == math.ceil(dense.kv_cache_bytes / 4 * (1 + 2 / 64))  # int8 instead of float32
    assert preflight(ServerConfig(mock=True, context_length=10**8)) is None  # the mock loads nothing
