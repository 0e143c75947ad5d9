"""The static decode step that CUDA graphs capture (engine/cuda_graphs.py), run eagerly on the CPU: the same
logits as the runner's own decode step, idle rows untouched. On a GPU, tests/test_cuda.py replays the graphs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_quality import exact_plan
from tiny import tiny_llama_config
from torch.utils._python_dispatch import TorchDispatchMode

from inference_api.engine.cuda_graphs import DecodeGraphs, bucket_sizes, capture_decode, span_sizes
from inference_api.engine.engine import Engine
from inference_api.engine.messages import GenerateRequest, SamplingParams
from inference_api.engine.model_runner import ModelRunner
from inference_api.model.loader import load_model


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


PROMPTS = ["The capital of France is", "One, two, three, four,", "Water boils at", "Dear diary,", "Hi", "A cat"]


class _Count(TorchDispatchMode):
    """The operations torch dispatches, views left out (an op's own alias annotation says it returns a view): on
    CUDA each of the others is a kernel launch in the captured step."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def test_the_static_decode_step_launches_few_operations_a_layer(runner):
    """A decode step on CUDA is bound by its kernel launches (docs/performance.md): the captured step's work a
    layer stays within its budget. Counted on the CPU, where torch composes F.rms_norm of six operations (one
    fused kernel on CUDA). Each layer: two norms, four linears, the rotary, the cache's two writes, attention under
    the step's one additive mask (SDPA would convert a boolean one in every layer), the residuals and the SiLU-gate."""
    static = DecodeGraphs(runner.model, runner.cache, 5, runner.device, capture=False)
    with _Count() as count:
        static.model.forward(static._batch(1, 64), static.cache)
    layers = len(runner.model.layers)
    assert count.ops["_scaled_dot_product_flash_attention_for_cpu"] == layers
    assert count.ops["where"] <= 1 and count.ops["scalar_tensor"] == 0  # the mask made once, additive
    assert count.ops["cat"] == layers  # the rotary's alone: one block of queries is not copied through cat
    assert sum(count.ops.values()) <= 29 * layers + 10, count.ops.most_common()


def test_a_capture_that_fails_leaves_the_step_eager_with_a_warning(runner, caplog):
    """A capture that cannot be made (here: a model on the CPU) gives no graphs, so the decode step runs eagerly,
    and the log says why."""
    assert capture_decode(runner.model, runner.cache, 5, runner.device) is None
    assert "capturing the decode step in CUDA graphs failed" in caplog.text


def _answers(runner, tokenizer, prompts: list[list[int]], ahead: bool) -> dict[str, list[int]]:
    """Six requests through an engine on the runner's 5 rows (so one waits for a row): greedy and seeded, ending
    at different lengths, one asking for log-probs; with or without the next step launched ahead."""
    engine = Engine(runner, tokenizer, 5, 64, 16, frozenset())
    if not ahead:
        engine.launch_ahead = None
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_tokens=4 + 3 * i,
            ignore_eos=True,
            temperature=0.8 if i % 3 == 1 else 0,
            seed=i,
            logprobs=2 if i == 2 else None,
        )
        engine.add(GenerateRequest(str(i), tuple(prompt), params))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for event in engine.step():
            assert event.error is None, event.error
            out[event.session_id].extend(event.token_ids)
    return out


def test_a_step_launched_ahead_gives_the_answers_of_a_step_launched_after_the_tokens_are_read(runner, hf_tokenizer):
    """The engine launches the next decode step from the sampled tokens before reading them back (CUDA graphs);
    rows that end, a request admitted into a freed row and a row wanting log-probs make it compute a step afresh.
    The static step runs eagerly here: the same answers with and without the step launched ahead."""
    runner.graphs = DecodeGraphs(runner.model, runner.cache, 5, runner.device, capture=False)
    try:
        _assert_ahead_answers_as_after(runner, hf_tokenizer, [hf_tokenizer.encode(p) for p in PROMPTS])
    finally:
        runner.graphs = None


def _assert_ahead_answers_as_after(runner, tokenizer, prompts: list[list[int]]) -> None:
    with_ahead = _answers(runner, tokenizer, prompts, ahead=True)
    used, launched = runner.graphs.used_ahead, runner.graphs.launched_ahead
    without = _answers(runner, tokenizer, prompts, ahead=False)
    assert with_ahead == without
    assert [len(t) for t in with_ahead.values()] == [4, 7, 10, 13, 16, 19]
    assert 0 < used < launched  # most steps from the launch ahead; some computed afresh (a row ended, log-probs)


class _Ids:
    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_captured_step_launched_ahead_answers_as_launched_after():
    """The same on a GPU with the graphs captured, on a tiny random llama in bfloat16 (8 heads, 4 KV heads)."""
    import transformers as T

    from inference_api.config import ServerConfig
    from inference_api.engine.plan import ModelFacts, make_plan, probe_machine

    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(tiny_llama_config(512)).to("cuda", torch.bfloat16).eval()
    plan = make_plan(ServerConfig(device="cuda"), ModelFacts("llama"), probe_machine("cuda"))
    assert plan.cuda_graphs and plan.model == "compact"
    runner = ModelRunner(model, 5, 64, plan)
    assert runner.graphs is not None and runner.graphs.captured == [1, 2, 4, 5]
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (5, 9, 3, 12, 1, 7)]
    _assert_ahead_answers_as_after(runner, _Ids(), prompts)


def _random_adapter(runner, name: str, seed: int, rank: int = 4):
    """A LoraAdapter of random A and B on every linear the model has."""
    from inference_api.model.lora import LoraAdapter, LoraWeight, targets

    gen = torch.Generator().manual_seed(seed)
    adapter = LoraAdapter(name, "<random>", float(rank))
    for tensor, t in targets(runner.config, runner.model.spec.family).items():
        a, b = torch.randn(rank, t.cols, generator=gen) * 0.05, torch.randn(t.rows, rank, generator=gen) * 0.05
        adapter.weights[tensor] = LoraWeight(a, b, 1.0)
    return adapter


def test_a_static_step_with_adapter_rows_gives_the_runners_logits_and_leaves_the_base_rows_alone(
    runner, hf_tokenizer, caplog
):
    """The static step of rows with LoRA adapters (the per-row plan CUDA graphs capture: each row's place in the
    stacks and scale as inputs) against the runner's eager step (the grouped matmuls): the same logits; a base
    row's logits bit for bit those of the step without adapters; a row of two adapters is left to the eager step;
    an adapter loaded later (the stacks rebuilt) is followed; a capture that fails leaves such steps eager."""
    from inference_api.model.lora import LoraSlots, targets

    lora = LoraSlots(
        targets(runner.config, runner.model.spec.family), runner.config.num_hidden_layers, "cpu", torch.float32
    )
    slots = [lora.add(_random_adapter(runner, f"a{i}", i)) for i in range(2)]
    runner.model.lora = lora
    static = DecodeGraphs(runner.model, runner.cache, 5, runner.device, capture=False)
    rows = [3, 0, 1]
    pairs = {3: ((slots[0], 1.0),), 1: ((slots[1], 0.5),)}
    try:
        ids = [hf_tokenizer.encode(p) for p in PROMPTS[:3]]
        first = runner.prefill(rows, ids, [0, 0, 0]).argmax(-1).tolist()
        positions = [len(i) for i in ids]
        for r in rows:
            runner.use_adapters(r, pairs.get(r, ()))
        adapters = [pairs.get(r, ()) for r in rows]
        expected = runner.decode(rows, first, positions)  # (no graphs on the runner: the eager step)
        assert static.takes(adapters) and not static.takes([((slots[0], 1.0), (slots[1], 1.0))])
        got = static.decode(rows, first, positions, adapters)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        plain = static.decode(rows, first, positions)
        assert torch.equal(got[1], plain[1])  # row 0, no adapter: untouched
        assert not torch.allclose(got[0], plain[0], atol=1e-2) and not torch.allclose(got[2], plain[2], atol=1e-2)
        generation = lora.generation
        lora.add(_random_adapter(runner, "later", 7))
        assert lora.generation == generation + 1
        again = static.decode(rows, first, positions, adapters)
        assert static.lora_generation == lora.generation
        torch.testing.assert_close(again, got, rtol=1e-5, atol=1e-5)
        static.capture_lora = True  # a capture tried on the CPU fails: the step is the eager one, with a warning
        torch.testing.assert_close(static.decode(rows, first, positions, adapters), got, rtol=1e-5, atol=1e-5)
        assert not static.capture_lora and not static.lora_graphs
        assert "capturing a decode step with adapter rows failed" in caplog.text
    finally:
        for r in rows:
            runner.use_adapters(r, ())
        runner.model.lora = None
