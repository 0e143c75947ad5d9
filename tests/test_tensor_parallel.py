"""Tensor parallelism (--tensor-parallel-size N): real rank processes over gloo on loopback, CPU.

The embedded model (9 attention heads, 3 KV heads) is split over 3 ranks in the exact mode; a tiny random llama
(8 heads, 4 KV heads) over 2 and 4 ranks in-process. One 3-rank server serves the module's server tests; the
test that kills one of its ranks runs last.
"""

from __future__ import annotations

import functools
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import transformers as T
from greedy import JOBS, assert_greedy_equivalent, served_answers
from servers import MODEL_CACHE, ServerProcess, native, wait_for
from tiny import PROMPTS, engine_greedy, save_tiny_model, tiny_config, tiny_engine, tiny_llama_config

from inference_api.config import ServerConfig
from inference_api.engine.plan import Machine, ModelFacts, PlanError, make_plan
from inference_api.engine.preflight import PreflightError, estimate, preflight

ESSAY = {"text": "Write a very long essay about rivers.", "max_tokens": 400, "temperature": 0}


@pytest.fixture(scope="module")
def tp3_server():
    """The embedded model in the exact mode (float32 weights and KV cache) split over 3 ranks."""
    flags = ("--context-length", "512", "--rows", "41", "--quantize", "none", "--dtype", "float32")
    with ServerProcess("--model-cache-dir", MODEL_CACHE, *flags, "--tensor-parallel-size", "3") as server:
        yield server


def test_three_ranks_answer_as_generate_and_report_every_rank(tp3_server, model_name, reference):
    """The 40 prompts at once through the 3-rank server, a row each: each greedy answer equals transformers'
    generate alone (up to the near-ties the summation order may flip), while a 41st client goes away mid-stream;
    /health and /metrics show the three ranks, and the cancelled stream's row is freed."""
    health = tp3_server.health()
    assert health["tensor_parallel_size"] == 3 and health["quantize"] == "none"
    assert [r["rank"] for r in health["ranks"]] == [0, 1, 2] and all(r["alive"] for r in health["ranks"])
    assert health["ranks"][0]["pid"] == health["backend_pid"]

    def cancelled() -> None:
        """A client that goes away mid-stream, among the others: its row is freed on every rank's step."""
        r = native(tp3_server, model_name, ESSAY, chat=True, stream=True, timeout=300)
        assert next(r.iter_content(chunk_size=None))
        r.close()

    with ThreadPoolExecutor(1) as pool:
        gone = pool.submit(cancelled)
        texts = served_answers(tp3_server, model_name, JOBS)
        gone.result()
    assert len(set(texts)) > 30  # distinct prompts, distinct answers: nothing mixed or duplicated
    for (prompt, chat), text in zip(JOBS, texts):
        assert_greedy_equivalent(text, prompt, chat, reference)
    metrics = requests.get(tp3_server.url + "/metrics", timeout=5).text
    assert all(f'inference_engine_rank_up{{rank="{r}"}} 1.0' in metrics for r in range(3)), metrics
    health = tp3_server.wait_idle(timeout=20)
    assert health["rows_in_use"] == 0 and health["open_sessions"] == 0 and health["status"] == "ready"


def test_a_rank_killed_while_streaming_ends_the_request_and_the_group_restarts(tp3_server, model_name):
    """SIGKILL to rank 1 mid-stream: the stream ends with an error, rank 0 exits, the web worker starts a whole new
    group (fresh ranks, nothing of the old one left), and the next request is answered. Then the server stops (the
    module's last test) and no rank outlives it."""
    tp3_server.wait_idle()
    old = tp3_server.health()
    old_pids = [r["pid"] for r in old["ranks"]]
    r = native(tp3_server, model_name, ESSAY, chat=True, stream=True, timeout=120)
    chunks = r.iter_content(chunk_size=None)
    assert next(chunks)
    os.kill(old_pids[1], signal.SIGKILL)
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        for _ in chunks:  # the stream is cut, not ended as if complete
            pass
    assert wait_for(lambda: requests.get(tp3_server.url + "/health", timeout=5).status_code == 200, 240)
    health = tp3_server.health()
    assert health["engine_restarts"] == old["engine_restarts"] + 1
    assert len(health["ranks"]) == 3 and all(r["alive"] for r in health["ranks"])
    assert not {r["pid"] for r in health["ranks"]} & set(old_pids)
    assert wait_for(lambda: not any(_running(pid) for pid in old_pids), 20), "a rank of the old group survived"
    answer = native(
        tp3_server, model_name, {"text": "One, two,", "temperature": 0, "max_tokens": 4, "stream": False}, timeout=120
    )
    assert answer.status_code == 200 and answer.json()["completion_tokens"] == 4
    # SIGTERM, as a process manager sends it, with a stream in flight: the server drains (the stream ends whole),
    # then ends the engine, which ends its ranks; none outlives it
    pids = [r["pid"] for r in health["ranks"]]
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream_chunks, tp3_server.url, model_name, 24)
        assert wait_for(lambda: tp3_server.health()["rows_in_use"] == 1, 60)
        tp3_server.proc.send_signal(signal.SIGTERM)
        chunks = stream.result(timeout=120)
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert [e for e in events if e["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 24
    tp3_server.proc.wait(60)
    tp3_server.stop()
    assert wait_for(lambda: not any(_running(pid) for pid in pids), 20), "a rank outlived the server"


def _stream_chunks(url: str, model: str, max_tokens: int) -> list[str]:
    """An OpenAI completion streamed to its end: the data of its events."""
    r = requests.post(
        f"{url}/v1/completions",
        stream=True,
        timeout=120,
        json={
            "model": model,
            "prompt": "Write a very long essay about rivers.",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status_code == 200, r.text
    return [line.removeprefix("data: ") for line in r.iter_lines(decode_unicode=True) if line]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


# tiny random models, in-process
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, model_dir):
    """A random llama with 8 attention heads and 4 KV heads (divisible by 2 and 4) of 16 dims, the real tokenizer."""
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny-tp"), model_dir)


@functools.cache  # one rank's tokens serve every size's comparison
def _greedy(folder, size: int, quantize: str) -> list[list[int]]:
    """Each prompt's 10 greedy tokens from an engine split over ``size`` ranks, the prompts decoded together and
    the long one prefilled in chunks of 8."""
    engine, ready = tiny_engine(
        folder, 128, quantize=quantize, dtype="float32", kv_dtype="float32", tensor_parallel_size=size
    )
    try:
        assert ready.tensor_parallel_size == size and len(ready.rank_pids) == size - 1
        tok = T.AutoTokenizer.from_pretrained(folder)
        return engine_greedy(engine, [tok.encode(p) for p in PROMPTS], 10)
    finally:
        close = getattr(engine.runner, "close", None)
        if close is not None:
            close()


@pytest.mark.parametrize("size", [2, 4])
def test_a_tiny_model_split_over_ranks_answers_as_one_rank(tiny_llama, size):
    """The same float32 weights on 1 and on N ranks: the same greedy tokens."""
    assert _greedy(tiny_llama, size, "none") == _greedy(tiny_llama, 1, "none")


def test_an_input_split_that_breaks_quantized_blocks_is_refused():
    """4-bit blocks of 32 inputs: o's 64 inputs over 4 ranks would leave 16 a rank (a float weight quantized after
    the split, and a weight that is 4-bit blocks already alike); over 2 ranks the blocks stay whole."""
    from inference_api.engine.parallel import Shard
    from inference_api.model.compact import HFWeights
    from inference_api.model.families import describe
    from inference_api.model.linear import quantize as quantize_weight

    config = tiny_config("llama", 256, layers=1, initializer_range=None, num_key_value_heads=4)
    model = T.AutoModelForCausalLM.from_config(config)
    spec = describe(model.config)
    layer = HFWeights(model, spec.family).layer(0)
    blocks = {**layer, "o": quantize_weight(layer["o"], "int4")}
    for w in (layer, blocks):
        with pytest.raises(
            ValueError,
            match=r"--tensor-parallel-size 4: layer 0's attention output \(int4, 64 "
            r"inputs per row\) would split into 16 inputs per rank, not a whole "
            r"number of its 32-weight blocks",
        ):
            Shard(1, 4, "int4").split_layer(w, spec, 0)
        half = Shard(1, 2, "int4").split_layer(w, spec, 0)
        assert (
            half["o"].dequantize().equal(blocks["o"].dequantize()[:, 32:])
            if w is blocks
            else half["o"].shape == (64, 32)
        )
    assert (
        Shard(3, 4).split_layer(layer, spec, 0)["o"].equal(layer["o"][:, 48:])
    )  # float weights served float: any split


def test_a_level_types_blocks_split_whole():
    """An i-quant in IQ4_NL's nibbles over its own levels (kernels.LEVEL_TYPES: a type number past ggml's, a float32
    scale a block) splits by its blocks of 32 as any block type: each rank's columns are the whole weight's."""
    import numpy as np
    import torch

    from inference_api.engine.parallel import take_columns
    from inference_api.kernels import LEVEL_BLOCK
    from inference_api.kernels.quant import LEVEL_TYPES, BlockWeight

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(4, 4, LEVEL_BLOCK), dtype=np.uint8)  # 4 rows of 128 inputs
    raw[..., :4] = np.full((4, 4, 1), 0.01, dtype=np.float32).view(np.uint8)
    w = BlockWeight(torch.from_numpy(raw.reshape(4, -1)), LEVEL_TYPES["IQ2_XXS"][0], 128)
    whole = w.dequantize()
    assert take_columns(w, 64, 128, "w", 2).dequantize().equal(whole[:, 64:])
    with pytest.raises(ValueError, match=r"\(IQ2_XXS, 128 inputs per row\)"):
        take_columns(w, 16, 32, "w", 8)


# refusals and pre-flight, without loading weights
def test_head_counts_that_do_not_divide_are_refused_before_anything_loads():
    facts = ModelFacts("llama", gguf=True, gguf_quantize="int4", heads=9, kv_heads=3)
    assert make_plan(ServerConfig(tensor_parallel_size=3), facts, Machine()).tp == 3
    with pytest.raises(
        PlanError,
        match="--tensor-parallel-size 2: the model's 9 attention heads and 3 key/value heads do not divide by 2",
    ):
        make_plan(ServerConfig(tensor_parallel_size=2), facts, Machine())
    with pytest.raises(PlanError, match="transformers' layers, which cannot be split"):
        make_plan(ServerConfig(tensor_parallel_size=2), ModelFacts("gpt2", heads=4, kv_heads=4), Machine())
    assert make_plan(ServerConfig(tensor_parallel_size=2), ModelFacts(""), Machine()).tp == 2  # pre-flight of a hub id
    # the embedded model's own facts, through pre-flight (what `python -m inference_api` runs first)
    with pytest.raises(PreflightError, match="9 attention heads and 3 key/value heads do not divide by 2"):
        preflight(ServerConfig(model_cache_dir=Path(MODEL_CACHE), tensor_parallel_size=2, skip_preflight=True))


def test_preflight_counts_each_ranks_share():
    """3 ranks: each holds a third of the layers' weights and KV cache and the whole (tied) embedding; on CPU the
    three shares and runtimes must fit in the RAM together."""
    one = estimate(ServerConfig(model_cache_dir=Path(MODEL_CACHE), quantize="none", dtype="float32"))
    three = estimate(
        ServerConfig(model_cache_dir=Path(MODEL_CACHE), quantize="none", dtype="float32", tensor_parallel_size=3)
    )
    embedding = 49152 * 576 * 4  # float32, tied: on every rank
    assert three.ranks == 3 and three.kv_cache_bytes == pytest.approx(one.kv_cache_bytes / 3, abs=1)
    assert three.weights_bytes == pytest.approx(embedding + (one.weights_bytes - embedding) / 3, abs=1)
    assert three.needed_bytes == 3 * (three.weights_bytes + three.kv_cache_bytes + three.overhead_bytes)
    assert "3 tensor-parallel ranks sharing it, each: its 1/3 of the split layers" in three.summary()
