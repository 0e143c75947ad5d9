"""The CUDA path with the real default model: tinygemm's 4-bit matmul, quality, and HTTP under load.

Skipped where torch sees no CUDA device (CI has none); run on a GPU machine with
``python -m pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from greedy import JOBS, assert_greedy_equivalent, served_answers
from servers import model_server
from test_quality import exact_plan, perplexity, plan_for, text_ids  # noqa: F401 (fixture)

from inference_api.engine.cuda_graphs import DecodeGraphs
from inference_api.engine.model_runner import ModelRunner
from inference_api.kernels.quant import quantize_int4
from inference_api.model.linear import Int4CudaLinear, linear_factory
from inference_api.model.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def exact_cuda_server():
    yield from model_server("--device", "cuda", "--quantize", "none", "--dtype", "float32")


@pytest.fixture(scope="module")
def default_cuda_server():
    yield from model_server("--device", "cuda")


@pytest.fixture(scope="module")
def eager_cuda_server():
    """The defaults with the decode step run eagerly (no CUDA graphs)."""
    yield from model_server("--device", "cuda", "--no-cuda-graphs")


def assert_few_part_late(first: list[str], second: list[str], names: tuple[str, str]) -> None:
    """Two servers' (or loads') answers to the same greedy prompts: at most 4 part, each late (a near-tie of the
    other summation order), and the answers differ among themselves (a mixed or lost stream would part most)."""
    differ = [(a, b) for a, b in zip(first, second) if a != b]
    print(f"{len(differ)} of {len(first)} answers part between {names[0]} and {names[1]}")
    for a, b in differ:
        print(f"{names[0]}: {a!r}\n{names[1]}: {b!r}")
    assert len(set(second)) > 30
    assert len(differ) <= 4, differ
    for a, b in differ:  # parted late, not from the start
        assert a[:8] == b[:8], (a, b)


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
    assert health["cuda_graphs"] == [1, 2, 4, 8, 16, 24, 32]  # the decode step replayed from CUDA graphs
    texts = served_answers(exact_cuda_server, model_name, JOBS)
    assert len(set(texts)) > 30
    for (prompt, templated), text in zip(JOBS, texts):
        assert_greedy_equivalent(text, prompt, templated, reference)


def test_default_cuda_streams_under_load_equal_each_prompt_alone(default_cuda_server, model_name):
    """bfloat16 with tinygemm: 40 concurrent greedy requests (more than the rows) against the same prompts sent
    one at a time. A batch's size changes the GPU's summation order, so a near-tie may part a few answers;
    a mixed or lost stream would part most of them."""
    health = default_cuda_server.health()
    assert health["device"] == "cuda" and health["quantize"] == "int4" and health["dtype"] == "bfloat16"
    together = served_answers(default_cuda_server, model_name, JOBS)
    alone = served_answers(default_cuda_server, model_name, JOBS, workers=1)
    assert_few_part_late(alone, together, ("alone", "together"))


def test_decode_graphs_replay_the_eager_static_step(model_dir, hf_tokenizer):
    """The captured graphs against the same static step run eagerly, on the defaults (int4 tinygemm, bfloat16):
    the same kernels over the same tensors, so the same logits; and the next step from the graphs' tokens."""
    plan = plan_for("cuda")
    assert plan.cuda_graphs
    runner = ModelRunner(load_model(model_dir, "cuda", torch.bfloat16), 6, 128, plan)
    assert runner.graphs is not None and runner.graphs.captured == [1, 2, 4, 6] and runner.graphs.spans == [128]
    eager = DecodeGraphs(runner.model, runner.cache, 6, runner.device, capture=False)
    prompts = ["The capital of France is", "One, two, three, four,", "Water boils at"]
    ids = [hf_tokenizer.encode(p) for p in prompts]
    rows = [4, 0, 2]  # out of order, rows 1, 3 and 5 idle: the 6-row bucket
    tokens = runner.prefill(rows, ids, [0, 0, 0]).argmax(-1).tolist()
    positions = [len(i) for i in ids]
    for _ in range(4):
        replayed = runner.decode(rows, tokens, positions).clone()
        again = eager.decode(rows, tokens, positions)  # the same positions written again, the same values
        assert replayed.shape == (3, runner.vocab_size)
        torch.testing.assert_close(replayed, again, rtol=0, atol=1e-3)
        tokens, positions = replayed.argmax(-1).tolist(), [p + 1 for p in positions]
    one = runner.decode([0], [tokens[1]], [positions[1]]).clone()  # the 1-row graph
    torch.testing.assert_close(one, eager.decode([0], [tokens[1]], [positions[1]]), rtol=0, atol=1e-3)


def test_cuda_graphs_answer_as_the_eager_decode_step(default_cuda_server, eager_cuda_server, model_name):
    """The defaults with and without CUDA graphs, 40 greedy prompts at once on each: the same answers up to the
    near-ties a different summation order (static attention over a fixed span) can part."""
    assert default_cuda_server.health()["cuda_graphs"] == [1, 2, 4, 8, 16, 24, 32]
    assert eager_cuda_server.health()["cuda_graphs"] == []
    graphs = served_answers(default_cuda_server, model_name, JOBS)
    eager = served_answers(eager_cuda_server, model_name, JOBS)
    assert_few_part_late(eager, graphs, ("eager", "graphs"))
