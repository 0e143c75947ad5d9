"""The CUDA path with the real default model: tinygemm's 4-bit matmul, quality, and HTTP under load.

Skipped where torch sees no CUDA device (CI has none); run on a GPU machine with
``python -m pytest tests/test_cuda.py``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
import torch.nn.functional as F
from greedy import MAX_TOKENS, PROMPTS, assert_greedy_equivalent
from servers import MODEL_CACHE, ServerProcess
from test_quality import exact_plan, perplexity, plan_for, text_ids  # noqa: F401 (fixture)

from inference_api.engine.linear import Int4CudaLinear, linear_factory
from inference_api.engine.quant import quantize_int4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def cuda_server(*precision: str) -> ServerProcess:
    return ServerProcess(
        "--model-cache-dir",
        MODEL_CACHE,
        "--device",
        "cuda",
        "--context-length",
        "1024",
        "--max-waiting",
        "64",
        *precision,
    )


@pytest.fixture(scope="module")
def exact_cuda_server():
    server = cuda_server("--quantize", "none", "--dtype", "float32")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def default_cuda_server():
    server = cuda_server()
    yield server
    server.stop()


def answers(server, prompts: list[str], chat: list[bool], model_name: str, workers: int) -> list[str]:
    def one(job):
        prompt, templated = job
        route = "predictions" if templated else "inference"
        r = requests.post(
            f"{server.url}/{route}/{model_name}",
            timeout=300,
            json={"text": prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": False},
        )
        assert r.status_code == 200, r.text
        return r.json()["text"]

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, zip(prompts, chat)))


@pytest.mark.parametrize("bias", [False, True])
def test_tinygemm_int4_linear_is_linear_on_the_dequantized_weight(bias):
    torch.manual_seed(0)
    device = torch.device("cuda")
    w = quantize_int4(torch.randn(256, 576) * 0.05)
    b = torch.randn(256, device=device, dtype=torch.bfloat16) if bias else None
    assert Int4CudaLinear.fits(w, device)
    layer = linear_factory(device, torch.bfloat16, "int4", None)(w.dequantize(), b)
    assert isinstance(layer, Int4CudaLinear)
    for rows in (1, 7, 32, 300):
        x = torch.randn(rows, 576, device=device, dtype=torch.bfloat16)
        expected = F.linear(x.float(), w.dequantize().to(device), None if b is None else b.float())
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 256)
        # bfloat16 scales and zeros, bfloat16 output: a few 2 ** -8 of the outputs' size
        torch.testing.assert_close(y.float(), expected, rtol=0.02, atol=0.05)


def test_default_cuda_perplexity_is_within_two_percent_of_exact(model_dir, text_ids):  # noqa: F811 (fixture)
    precision = plan_for("cuda")
    assert precision.quantize == "int4" and precision.kv_dtype == "bfloat16"  # the GGUF's blocks, bf16 cache
    exact = perplexity(model_dir, exact_plan("cuda"), text_ids)
    default = perplexity(model_dir, precision, text_ids)
    one_row = perplexity(model_dir, precision, text_ids, decode=True)
    print(
        f"\nCUDA perplexity on {len(text_ids)} tokens: exact (float32) {exact:.3f}; default (int4 tinygemm, "
        f"bfloat16): {default:.3f} ({(default / exact - 1) * 100:+.2f} %), one token at a time {one_row:.3f} "
        f"({(one_row / exact - 1) * 100:+.2f} %)"
    )
    assert exact < 40
    assert default <= exact * 1.02 and one_row <= exact * 1.02


def test_forty_concurrent_greedy_requests_on_cuda_float32_match_generate(exact_cuda_server, model_name, reference):  # noqa: E501
    health = exact_cuda_server.health()
    assert health["device"] == "cuda" and health["quantize"] == "none"
    chat = [i % 5 == 4 for i in range(len(PROMPTS))]
    texts = answers(exact_cuda_server, PROMPTS, chat, model_name, len(PROMPTS))
    assert len(set(texts)) > 30
    for prompt, templated, text in zip(PROMPTS, chat, texts):
        assert_greedy_equivalent(text, prompt, templated, reference)


def test_default_cuda_streams_under_load_equal_each_prompt_alone(default_cuda_server, model_name):
    """bfloat16 with tinygemm: 40 concurrent greedy requests (more than the rows) against the same prompts sent
    one at a time. A batch's size changes the GPU's summation order, so a near-tie may part a few answers;
    a mixed or lost stream would part most of them."""
    health = default_cuda_server.health()
    assert health["device"] == "cuda" and health["quantize"] == "int4" and health["dtype"] == "bfloat16"
    chat = [i % 5 == 4 for i in range(len(PROMPTS))]
    together = answers(default_cuda_server, PROMPTS, chat, model_name, len(PROMPTS))
    alone = answers(default_cuda_server, PROMPTS, chat, model_name, 1)
    differ = [(a, t) for a, t in zip(alone, together) if a != t]
    print(f"{len(differ)} of {len(PROMPTS)} answers part from the prompt alone")
    for a, t in differ:
        print(f"alone:    {a!r}\ntogether: {t!r}")
    assert len(set(together)) > 30
    assert len(differ) <= 4, differ
    for a, t in differ:  # parted late, not from the start
        assert a[:8] == t[:8], (a, t)
