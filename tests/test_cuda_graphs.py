"""The static decode step that CUDA graphs capture (engine/cuda_graphs.py), run eagerly on the CPU: the same
logits as the runner's own decode step, idle rows untouched. On a GPU, tests/test_cuda.py replays the graphs."""

from __future__ import annotations

import pytest
import torch
from test_quality import exact_plan

from inference_api.engine.cuda_graphs import DecodeGraphs, bucket_sizes, span_sizes
from inference_api.engine.model_runner import ModelRunner
from inference_api.model_loader import load_model


def test_the_buckets_cover_every_row_count_with_few_graphs():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert bucket_sizes(41) == [1, 2, 4, 8, 16, 24, 32, 40, 41]
    assert span_sizes(2048) == [256, 512, 1024, 2048] and span_sizes(64) == [64] and span_sizes(300) == [256, 300]


@pytest.fixture(scope="module")
def runner(model_dir):
    """The real model in float32 on SDPA (no CPU kernels: the path a GPU runs), 5 rows of 64 positions."""
    return ModelRunner(load_model(model_dir, "cpu", torch.float32), 5, 64, exact_plan(), kernels=None)


def test_the_static_decode_step_gives_the_runners_logits_and_leaves_idle_rows_alone(runner, hf_tokenizer):
    prompts = ["The capital of France is", "One, two, three, four,", "Water boils at"]
    ids = [hf_tokenizer.encode(p) for p in prompts]
    rows = [3, 0, 1]  # not in order, rows 2 and 4 idle
    first = runner.prefill(rows, ids, [0, 0, 0]).argmax(-1).tolist()
    positions = [len(i) for i in ids]
    idle = [(runner.cache.keys[5][r].clone(), runner.cache.values[5][r].clone()) for r in (2, 4)]
    expected = runner.decode(rows, first, positions)
    static = DecodeGraphs(runner.model, runner.cache, 5, runner.device, capture=False)
    got = static.decode(rows, first, positions)  # rows 0..3 in the 4-row bucket, the same positions written again
    assert got.shape == expected.shape == (3, runner.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    for r, (k, v) in zip((2, 4), idle):  # idle rows wrote only their scratch slot
        assert torch.equal(runner.cache.keys[5][r, :, :64], k[:, :64])
        assert torch.equal(runner.cache.values[5][r, :, :64], v[:, :64])
    # a step of every row (the bucket exactly) and of row 0 alone: each row's logits as the runner's
    nxt = expected.argmax(-1).tolist()
    after = [p + 1 for p in positions]
    torch.testing.assert_close(
        static.decode([1], [nxt[2]], [after[2]]), runner.decode([1], [nxt[2]], [after[2]]), rtol=1e-4, atol=1e-4
    )
