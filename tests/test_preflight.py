"""Pre-flight arithmetic and decisions, without loading any weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from servers import MODEL_CACHE

from inference_api.config import ServerConfig
from inference_api.engine.plan import Machine, ModelFacts, make_plan
from inference_api.engine.preflight import (
    GiB,
    PreflightError,
    bytes_per_kv,
    bytes_per_weight,
    estimate_bytes,
    layer_kv_bytes,
    model_plan,
    preflight,
    safetensors_params,
    shape_from_config,
)

SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def test_estimate_bytes_is_weights_plus_keys_and_values_for_every_row_and_position():
    weights, kv = estimate_bytes(1000, 0.5, 2, num_layers=2, num_kv_heads=3, head_dim=4, rows=5, context_length=9)
    assert weights == 500
    # an untied embedding dense, the head in int8 groups of 32, the rest at 0.5
    assert (
        estimate_bytes(
            1000, 0.5, 2, 2, 3, 4, 5, 9, dense_params=100, bytes_per_dense=4, head_params=100, bytes_per_head=1.25
        )[0]
        == 800 * 0.5 + 100 * 4 + 100 * 1.25
    )
    assert kv == 2 * 2 * 5 * 3 * (9 + 1) * 4 * 2  # keys and values, layers, rows, heads, positions (+scratch)


def test_the_parameter_count_from_the_config_matches_the_weights(model_dir):
    assert shape_from_config(SMOLLM2).num_params == safetensors_params(model_dir) == 134_515_008


GGUF4 = ModelFacts("llama", gguf=True, gguf_quantize="int4")
ZEN3 = Machine(frozenset({"avx2", "fma"}))
ZEN4 = Machine(frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"}))
SPR = Machine(frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}))
BF16_ONLY = Machine(frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))  # bfloat16 without VNNI
CUDA = Machine(frozenset({"avx2"}), cuda=True, cuda_bf16=True)


def plan(machine=ZEN3, model=GGUF4, **flags):
    return make_plan(ServerConfig(**flags), model, machine)


def test_the_plan_decides_device_dtypes_kv_and_kernels_once():
    zen3, zen4, spr, cuda = plan(), plan(ZEN4), plan(SPR), plan(CUDA)
    assert (zen3.device, zen3.dtype, zen3.quantize, zen3.kv_dtype, zen3.group) == ("cpu", "float32", "int4", "int8", 32)
    assert zen3.cpu_kernels and zen3.int8_inputs and not zen3.vnni and zen3.batch_dtype is None
    assert zen4.vnni and zen4.batch_dtype is None and zen4.matmul_dtype == "int8"  # VNNI beats a bfloat16 copy
    # AMX too: the VNNI tiles (batch-invariant, no copy, faster at 32 rows); a bfloat16 copy only without VNNI
    assert spr.vnni and spr.batch_dtype is None
    assert plan(BF16_ONLY).batch_dtype == "bfloat16" and not plan(BF16_ONLY).vnni
    assert (cuda.device, cuda.dtype, cuda.kv_dtype, cuda.cpu_kernels) == ("cuda", "bfloat16", "bfloat16", False)
    # CUDA graphs for the compact model's decode step on CUDA alone, unless turned off
    assert cuda.cuda_graphs and not zen3.cuda_graphs and not plan(CUDA, cuda_graphs=False).cuda_graphs
    assert not plan(CUDA, model=ModelFacts("gpt2", gguf=True, gguf_quantize="int8")).cuda_graphs
    exact = plan(dtype="float32")
    assert exact.quantize == "int4" and not exact.int8_inputs and exact.kv_dtype == "int8"
    # --embedding: the token vectors with float inputs (llama-server's within cosine 0.999), on every CPU
    for machine in (ZEN3, ZEN4, BF16_ONLY):
        vectors = plan(machine, embedding=True)
        assert vectors.quantize == "int4" and not vectors.int8_inputs and vectors.batch_dtype is None
    assert plan(model=ModelFacts("llama"), quantize="auto").quantize == "none"  # a folder is served as it is
    assert plan(quantize="int8").quantize == "int8"
    # transformers' layers cannot read an int8 cache: the fallback's cache is the model's dtype, as allocated
    fallback = plan(model=ModelFacts("gpt2", gguf=True, gguf_quantize="int8"))
    assert (fallback.model, fallback.kv_dtype) == ("transformers", "float32")
    assert plan(model=ModelFacts("gemma3_text", gguf=True, gguf_quantize="int8")).model == "compact"
    # the layers whose keys carry outlier channels (Qwen2.5's first layers' key biases) keep float16 in an int8
    # cache, unless a cache type is asked for
    qwen2 = ModelFacts("qwen2", gguf=True, gguf_quantize="int4", key_outliers=(0, 1, 7))
    assert (plan(model=qwen2).kv_dtype, plan(model=qwen2).kv_float_layers) == ("int8", (0, 1, 7))
    assert "KV cache int8 (layers 0, 1, 7 float16)" in plan(model=qwen2).describe()
    assert plan(model=qwen2, kv_dtype="int8").kv_float_layers == () == plan(CUDA, model=qwen2).kv_float_layers
    assert plan().kv_float_layers == ()


def test_a_key_bias_far_above_its_median_marks_its_layer(tmp_path):
    """gguf_meta.key_outliers: a layer whose key bias has a channel over KEY_OUTLIER times the bias's median
    magnitude (Qwen2.5-Coder 1.5B's layer 0: 354 against 0.69); read into the header (and the conversion's stamp),
    from which pre-flight and the plan take it."""
    from types import SimpleNamespace

    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf_reference import GGUF_DIR

    from inference_api.model.gguf_meta import KEY_OUTLIER, key_outliers, read_header

    def bias(layer: int, top: float):
        data = np.full(64, 0.5, dtype=np.float32)
        data[3] = top
        return SimpleNamespace(name=f"blk.{layer}.attn_k.bias", tensor_type=GGMLQuantizationType.F32, data=data)

    tensors = [bias(0, 0.5 * KEY_OUTLIER * 1.5), bias(1, 0.5 * KEY_OUTLIER * 0.9), bias(2, -400.0)]
    assert key_outliers(tensors) == [0, 2]
    assert read_header(GGUF_DIR / "qwen2-q4_k_m.gguf")["key_outliers"] == []  # a random model's small biases


def test_bytes_follow_dtype_quantization_and_kv_dtype():
    # kernels/quant.py's layouts: int4 half a byte plus float16 scale and minimum per 32; int8 a byte plus a
    # float32 scale per 32 (GGUF) or per output channel of K inputs (folder); on CPU also the bfloat16 copy
    # that oneDNN runs several rows on (linear.SplitLinear) where the CPU multiplies bfloat16 and --dtype is
    # auto; and the weights packed for the VNNI tiles where the CPU has AVX512-VNNI
    assert bytes_per_weight(plan(), "none") == 4 and bytes_per_weight(plan(CUDA), "none") == 2
    assert bytes_per_weight(plan(CUDA), "int4") == 0.5 + 4 / 32 and bytes_per_weight(plan(CUDA), "int8") == 1 + 4 / 32
    assert bytes_per_weight(plan()) == 0.5 + 4 / 32
    assert bytes_per_weight(plan(ZEN4)) == 2 * (0.5 + 4 / 32)  # and its VNNI packing
    assert bytes_per_weight(plan(SPR)) == 2 * (0.5 + 4 / 32)
    assert bytes_per_weight(plan(BF16_ONLY)) == 0.5 + 4 / 32 + 2  # a bfloat16 copy
    assert bytes_per_weight(plan(ZEN4, dtype="float32")) == 0.5 + 4 / 32
    assert bytes_per_weight(plan(dtype="float32"), "int8") == 1 + 4 / 32
    assert bytes_per_weight(plan(dtype="float32"), "int8", in_features=576) == 1 + 4 / 576
    assert bytes_per_kv(plan(kv_dtype="bfloat16")) == 2
    assert bytes_per_kv(plan(model=ModelFacts("llama"), dtype="float16")) == 2
    # int8 next to quantized weights on CPU: a byte per value and a float16 scale per head vector
    assert bytes_per_kv(plan(), head_dim=64) == 1 + 2 / 64 and bytes_per_kv(plan(quantize="none")) == 4
    assert bytes_per_kv(plan(CUDA)) == 2  # the model's dtype on CUDA
    outliers = plan(model=ModelFacts("qwen2", gguf=True, gguf_quantize="int4", key_outliers=(1,)))
    assert layer_kv_bytes(outliers, 3, head_dim=64) == [1 + 2 / 64, 2, 1 + 2 / 64]
    full = estimate_bytes(0, 0, [1.0, 2.0], num_layers=2, num_kv_heads=1, head_dim=4, rows=1, context_length=9)[1]
    assert full == 2 * 1 * 10 * 4 * (1 + 2)  # keys and values, 9 positions and the scratch, each layer's bytes


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
    here = model_plan(ServerConfig(model_cache_dir=Path(MODEL_CACHE)))  # this machine's plan for the default model
    bf16 = 2 if here.batch_dtype else 0
    vnni4 = 0.5 + 4 / 32 if here.vnni else 0
    vnni8 = 1 + 4 / 32 if here.int8_inputs else 0  # the head packed at both levels, its codes kept for lookups
    assert default.weights_bytes == math.ceil(
        (134_515_008 - head) * (0.5 + 4 / 32 + bf16 + vnni4) + head * (1 + 4 / 32 + bf16 + vnni8)
    )
    assert default.kv_cache_bytes == math.ceil(dense.kv_cache_bytes / 4 * (1 + 2 / 64))  # int8 instead of float32
    assert preflight(ServerConfig(mock=True, context_length=10**8)) is None  # the mock loads nothing


@pytest.mark.parametrize("flags", [{}, {"quantize": "none", "dtype": "float32"}, {"kv_dtype": "bfloat16"}])
def test_pre_flight_sizes_the_kv_cache_the_engine_allocates(flags):
    """Pre-flight and the engine read one execution plan: the KV cache pre-flight announces is the one the
    engine then allocates, byte for byte, in every mode."""
    from inference_api.engine.process import build_engine

    config = ServerConfig(model_cache_dir=Path(MODEL_CACHE), rows=3, context_length=64, **flags)
    est = preflight(ServerConfig(**{**config.__dict__, "skip_preflight": True}))
    engine, ready = build_engine(config)
    assert est.kv_cache_bytes == engine.runner.cache.nbytes
    assert ready.kv_dtype == model_plan(config).kv_dtype == engine.runner.plan.kv_dtype


def test_pre_flight_counts_sliding_window_layers_as_the_rings_the_engine_keeps():
    """A Gemma 3 GGUF (five layers in six slide over 16 positions): pre-flight counts each sliding layer's ring of
    window + prefill chunk, not the context, and the engine allocates exactly that."""
    from gguf_reference import GGUF_DIR

    from inference_api.engine.process import build_engine

    config = ServerConfig(
        model=str(GGUF_DIR / "gemma3-q4_k_m.gguf"),
        model_cache_dir=Path(MODEL_CACHE),
        rows=2,
        context_length=256,
        prefill_chunk=32,
    )
    est = preflight(ServerConfig(**{**config.__dict__, "skip_preflight": True}))
    engine, _ = build_engine(config)
    assert engine.runner.cache.layer_slots == [48] * 5 + [256]
    assert est.kv_cache_bytes == engine.runner.cache.nbytes
    full = estimate_bytes(0, 0, bytes_per_kv(model_plan(config), 64), 6, 1, 64, 2, 256)[1]
    assert est.kv_cache_bytes < full / 2


def test_a_cpu_level_plans_as_a_cpu_with_that_level_alone():
    """--cpu-level avx2 on an AVX-512 VNNI machine: the AVX2 kernels' plan (no VNNI tiles, no bfloat16 copy), to
    measure one level against the other on one machine; a level the CPU lacks stops the start with a reason."""
    from inference_api.engine.plan import LEVELS, PlanError

    full = Machine(LEVELS["avx512vnni"][1] | LEVELS["avx2"][1] | {"avx512_bf16"})
    auto, avx2, vnni = plan(full), plan(full, cpu_level="avx2"), plan(full, cpu_level="avx512vnni")
    assert auto.vnni and auto.cpu_level is None
    assert avx2.cpu_level == "avx2" and not avx2.vnni and avx2.int8_inputs and avx2.batch_dtype is None
    assert vnni.cpu_level == "avx512vnni" and vnni.vnni
    # a Q8_0 embedding and tied head in the int8 layout wherever int8 inputs run (not with float32 inputs)
    assert avx2.int8_layout and vnni.int8_layout and not plan(full, dtype="float32").int8_layout
    # the tiles at both levels take Q5_0's own blocks packed at load (22 bytes a row and block against 36)
    assert "Q5_0" not in vnni.int8_layout and "Q5_0" not in avx2.int8_layout
    with pytest.raises(PlanError, match="lacks avx512"):
        plan(Machine(LEVELS["avx2"][1]), cpu_level="avx512vnni")
    assert plan(CUDA, cpu_level="avx2").cpu_level is None  # no CPU kernels on CUDA


@pytest.mark.parametrize(
    ("arch", "tokenizer", "said"),
    [("rwkv7", "gpt2", "architecture 'rwkv7' is not supported; supported: "), ("llama", "ugm", "tokenizer 'ugm'")],
)
def test_a_file_the_server_cannot_serve_stops_the_start(tmp_path, arch, tokenizer, said):
    """An architecture or a tokenizer this server does not know: exit 2 at once with the reason and what is
    supported (with --skip-preflight too), not an engine that fails while the server stays up."""
    import subprocess
    import sys

    from gguf import GGUFWriter

    path = tmp_path / "unknown.gguf"
    writer = GGUFWriter(str(path), arch)
    writer.add_tokenizer_model(tokenizer)
    writer.add_tensor("token_embd.weight", __import__("numpy").zeros((4, 4), dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    r = subprocess.run(
        [sys.executable, "-m", "inference_api", "--model", str(path), "--skip-preflight", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and said in r.stderr, r.stderr[-2000:]
    if "architecture" in said:
        assert "nomic-bert" in r.stderr and "llama" in r.stderr  # the supported ones, listed


def test_an_embedding_model_is_planned_as_the_encoder_with_no_kv_or_prompt_cache():
    """A BERT GGUF runs on model/encoder.py (one forward an input): no rows' KV cache, no prompt cache and no
    float32 conversion counted, only its weights and the runtime (the pool unloads other models by these)."""
    from gguf_reference import GGUF_DIR

    from inference_api.engine.preflight import estimate

    config = ServerConfig.from_args(["--model", str(GGUF_DIR / "bert-q8_0.gguf"), "--model-cache-dir", MODEL_CACHE], {})
    assert model_plan(config).model == "encoder"
    e = estimate(config)
    assert e.kv_cache_bytes == 0 and e.prompt_cache_bytes == 0 and 0 < e.weights_bytes < 2**20
    assert e.disk_needed_bytes <= 64 * 2**20  # at most the tokenizer, never the weights converted


def test_matrices_of_a_type_the_kernels_lack_count_at_the_dense_bytes_they_are_served_in(tmp_path, monkeypatch):
    """gguf-py dequantizes a matrix of a type the kernels lack, and the layer is served dense (gguf_model): pre-flight
    counts those weights at the dense bytes, not at the mode's (here Q6_K taken off the kernels' list, on the Q6_K
    file: 4 bytes a weight on the CPU, where the plan's mode holds 1.125, or 2.25 with the VNNI copy)."""
    from gguf_reference import GGUF_DIR

    from inference_api.model import gguf_meta

    config = ServerConfig(
        model=str(GGUF_DIR / "llama-q6_k.gguf"),
        model_cache_dir=tmp_path,
        rows=2,
        context_length=256,
        skip_preflight=True,
    )
    served = preflight(config)
    assert gguf_meta.read_header(config.model)["float_params"] == 0
    monkeypatch.setattr(gguf_meta, "BLOCK_TYPES", gguf_meta.BLOCK_TYPES - {"Q6_K"})
    header = gguf_meta.read_header(config.model)
    assert header["float_params"] >= header["num_params"] // 2
    plan = model_plan(config)
    dense, quantized = bytes_per_weight(plan, "none"), bytes_per_weight(plan)
    assert dense == 4.0 and quantized < dense
    lacking = preflight(config)
    assert lacking.weights_bytes - served.weights_bytes == math.ceil(header["float_params"] * (dense - quantized))


def test_the_i_quants_that_scale_blocks_of_16_count_at_the_int8_layouts_bytes(tmp_path, monkeypatch):
    """IQ2_XS (IQ_INT8_TYPES) is served in the int8 layout where the kernels take int8 inputs: pre-flight counts its
    weights at the mode's bytes, where a type the kernels lack counts at float32's."""
    from gguf_reference import GGUF_DIR

    from inference_api.model import gguf_meta

    config = ServerConfig(
        model=str(GGUF_DIR / "llama-iq2_xs.gguf"), model_cache_dir=tmp_path, rows=2, context_length=256
    )
    plan = model_plan(config)
    assert plan.int8_inputs and "IQ2_XS" in plan.int8_layout
    header = gguf_meta.read_header(config.model)
    assert header["float_params"] == 0 and header["iq_params"] >= header["num_params"] // 2
    served = preflight(config)
    monkeypatch.setattr(gguf_meta, "IQ_INT8_TYPES", set())
    assert gguf_meta.read_header(config.model)["float_params"] == header["iq_params"]
    dense, quantized = bytes_per_weight(plan, "none"), bytes_per_weight(plan)
    as_float = preflight(config)
    assert as_float.weights_bytes - served.weights_bytes == math.ceil(header["iq_params"] * (dense - quantized))


def test_an_untied_token_embedding_left_in_the_file_counts_no_bytes_on_the_cpu(tmp_path):
    """A GGUF's untied token embedding stays in the mapped file on the CPU (gguf_blocks.file_rows): pre-flight counts
    the layers and the output head, not a copy of the table (it counted one in float32: 4 bytes a weight)."""
    from gguf_reference import GGUF_DIR

    from inference_api.engine.preflight import HEAD_BYTES, batch_copy_bytes
    from inference_api.model import gguf_meta

    config = ServerConfig(
        model=str(GGUF_DIR / "llama-q4_k_m.gguf"), model_cache_dir=tmp_path, rows=2, context_length=256
    )
    header = gguf_meta.read_header(config.model)
    assert not header["tied"] and header["float_params"] == 0
    plan = model_plan(config)
    vocab = header["vocab_params"]
    head = HEAD_BYTES + batch_copy_bytes(plan, "int8", head=True)
    want = (header["num_params"] - 2 * vocab) * bytes_per_weight(plan) + vocab * head
    assert preflight(config).weights_bytes == math.ceil(want)
