"""Quality of the quantized default against the exact mode on the real model, in-process."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from servers import MODEL_CACHE

from inference_api.config import ServerConfig
from inference_api.engine.model_runner import ModelRunner
from inference_api.engine.plan import ExecutionPlan, ModelFacts, make_plan, probe_machine
from inference_api.kernels import load_kernels
from inference_api.model.loader import load_model

EMBEDDED = ModelFacts("llama", gguf=True, gguf_quantize="int4")  # the embedded SmolLM2 Q4_1 GGUF


def plan_for(device: str = "cpu", **flags) -> ExecutionPlan:
    """The plan the server makes for the embedded model with these flags on this machine."""
    return make_plan(ServerConfig(device=device, **flags), EMBEDDED, probe_machine(device))


def exact_plan(device: str = "cpu") -> ExecutionPlan:
    return plan_for(device, quantize="none", dtype="float32", kv_dtype="float32")


def int8_cache_plan() -> ExecutionPlan:
    """The default weights and int8 cache with float32 inputs (no bfloat16 copy, no int8 inputs)."""
    return replace(plan_for(), batch_dtype=None, int8_inputs=False, vnni=False)


TEXT = Path(__file__).with_name("data") / "english.txt"
CHUNK = 128  # fed through the row cache in prefill chunks, so later chunks read earlier ones back


def perplexity(model_dir: Path, plan: ExecutionPlan, ids: list[int], decode: bool = False) -> float:
    """exp of the mean negative log-likelihood of each next token, every chunk attending to the cache; with
    decode, one token at a time through the decode step (the one-row kernels a single stream runs on)."""
    kernels = load_kernels(Path(MODEL_CACHE)) if plan.cpu_kernels else None
    runner = ModelRunner(load_model(model_dir, plan.device, plan.torch(plan.dtype)), 1, len(ids) + 1, plan, kernels)
    nll = 0.0
    with torch.inference_mode():
        if decode:
            logits = runner.prefill([0], [ids[:1]], [0])[0]
            for i in range(1, len(ids)):
                nll -= float(torch.log_softmax(logits.float(), -1)[ids[i]])
                if i + 1 < len(ids):
                    logits = runner.decode([0], [ids[i]], [i])[0]
            return math.exp(nll / (len(ids) - 1))
        for start in range(0, len(ids) - 1, CHUNK):
            chunk = ids[start : start + CHUNK]
            logits = runner.score(0, chunk, start)
            targets = torch.tensor(ids[start + 1 : start + len(chunk) + 1], device=logits.device)
            lp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
            nll -= float(lp.gather(1, targets[:, None]).sum())
    return math.exp(nll / (len(ids) - 1))


@pytest.fixture(scope="module")
def text_ids(hf_tokenizer) -> list[int]:
    ids = hf_tokenizer.encode(TEXT.read_text())
    assert len(ids) > 900
    return ids


def test_quantized_default_perplexity_is_within_two_percent_of_exact(model_dir, text_ids):
    precision = plan_for()
    # the embedded Q4_1 GGUF keeps its 4-bit blocks; the cache is int8
    assert (precision.quantize, precision.kv_dtype, precision.model) == ("int4", "int8", "compact")
    exact = perplexity(model_dir, exact_plan(), text_ids)
    default = perplexity(model_dir, precision, text_ids)  # prefill: several rows at once
    one_row = perplexity(model_dir, precision, text_ids, decode=True)  # a single stream's decode steps
    vnni = precision.int8_inputs and load_kernels(Path(MODEL_CACHE)).vnni()  # every row count on int8 inputs
    matmuls = "int8 (VNNI)" if vnni else precision.batch_dtype or ("int8" if precision.int8_inputs else "float32")
    inputs = "int8" if precision.int8_inputs else "float32"
    print(
        f"\nperplexity on {len(text_ids)} tokens: exact {exact:.3f}; default ({precision.quantize} weights, "
        f"int8 KV cache): {default:.3f} ({(default / exact - 1) * 100:+.2f} %) with {matmuls} multi-row "
        f"matmuls, {one_row:.3f} ({(one_row / exact - 1) * 100:+.2f} %) one token at a time with {inputs} "
        "one-row inputs"
    )
    assert exact < 40  # the model reads English: a broken forward gives hundreds or thousands
    assert default <= exact * 1.02 and one_row <= exact * 1.02


@pytest.mark.parametrize("matmuls", ["float32", "default"])
def test_decode_kernels_over_the_int8_cache_match_the_prefill_path(model_dir, text_ids, matmuls):
    """The next token's logits through the decode kernels (int8 cache written by rope_store, read by
    decode_attention; one row and two rows at once; the one-call Decoder and the same kernels called layer
    by layer from Python, which must agree exactly) against the whole sequence through the prefill path,
    which rounds keys and values the same way. float32 matmuls: equal up to summation order, except where
    that order moves a cached value across a rounding boundary of the int8 cache (one step of a head's
    scale: a few hundredths on the logits); the default (one row's inputs rounded to int8 blocks, bfloat16
    for several rows where the CPU has it): within that rounding's noise on logits of about 26 (up to 1.4
    measured with int8 inputs; the perplexity test bounds what it costs)."""
    precision = plan_for() if matmuls == "default" else int8_cache_plan()
    runner = ModelRunner(
        load_model(model_dir, "cpu", torch.float32), 3, 256, precision, load_kernels(Path(MODEL_CACHE))
    )
    ids = text_ids[:40]
    with torch.inference_mode():
        runner.prefill([0, 1], [ids[:39], ids[:39]], [0, 0])
        one = runner.decode([0], [ids[39]], [39])[0]
        two = runner.decode([0, 1], [ids[39]] * 2, [39, 39])
        whole = runner.prefill([2], [ids], [0])[0]
        decoder, runner.model.fused = runner.model.fused, None  # forward's one layer loop over the same kernels
        layer_by_layer = runner.decode([0], [ids[39]], [39])[0]
    assert decoder is not None and torch.equal(layer_by_layer, one)
    assert precision.int8_inputs == (matmuls == "default")
    tolerance = 0.15 if matmuls == "float32" else 3.0
    for logits in (whole, two[0], two[1]):
        assert (logits - one).abs().max() < tolerance
    assert int(one.argmax()) == int(whole.argmax())


def _int8_cache_runner(model_dir: Path) -> ModelRunner:
    """3 rows of 64 positions: the default weights and int8 cache, float32 inputs (with the defaults a
    chunk of up to 16 tokens would take int8 inputs, a longer one not)."""
    return ModelRunner(
        load_model(model_dir, "cpu", torch.float32), 3, 64, int8_cache_plan(), load_kernels(Path(MODEL_CACHE))
    )


def test_a_prefix_copied_from_another_row_gives_the_logits_of_computing_it_there(model_dir, text_ids):
    """The prefix cache: row 1 takes row 0's first 24 positions (int8 keys, values and scales) and computes
    only the rest of the prompt; its last logits match row 0's, which computed the whole prompt. Row 2 gets
    the same rest without the copy: attention then reads an empty prefix, and the logits are far off."""
    runner = _int8_cache_runner(model_dir)
    ids = text_ids[:40]
    with torch.inference_mode():
        whole = runner.prefill([0], [ids], [0])[0]
        runner.copy_prefix(0, 1, 24)
        rest = runner.prefill([1], [ids[24:]], [24])[0]
        uncopied = runner.prefill([2], [ids[24:]], [24])[0]
    print(
        f"\ncopied prefix: {float((rest - whole).abs().max()):.2e}; none: {float((uncopied - whole).abs().max()):.2f}"
    )
    assert (rest - whole).abs().max() < 0.15  # as the decode test: summation order vs int8 rounding steps
    assert (uncopied - whole).abs().max() > 1.0


def test_a_one_token_prefill_runs_in_its_own_row(model_dir, text_ids):
    """A prompt sent again finds all but its last token in the prefix cache, so its prefill is one token:
    that token is written to and attends to its own row (row 2 here), as a longer chunk would, and no other
    row's cache changes (the decode step's batch index would have put it in row 0, another stream's)."""
    runner = _int8_cache_runner(model_dir)
    cache = runner.cache
    ids = text_ids[:40]
    with torch.inference_mode():
        whole = runner.prefill([1], [ids], [0])[0]
        runner.copy_prefix(1, 2, 39)
        runner.prefill([0, 1], [text_ids[40:80], text_ids[80:120]], [0, 0])  # other streams in rows 0 and 1
        stores = cache.keys + cache.values + cache.key_scales + cache.value_scales
        others = [store[:2].clone() for store in stores]
        last = runner.prefill([2], [ids[39:]], [39])[0]
    assert (last - whole).abs().max() < 0.15  # as the tests above: summation order vs int8 rounding steps
    assert all(torch.equal(store[:2], before) for store, before in zip(stores, others))


@pytest.mark.parametrize("kernels", ["cpu kernels", "torch ops (the CUDA path)"])
def test_chunks_of_different_lengths_prefilled_together_match_transformers(model_dir, text_ids, kernels):
    """One prefill of chunks of 5, 17 and 40 tokens runs the norms and linears on their 62 tokens only (the
    shorter chunks' padding left out) and attention on the padded layout: each chunk's last logits, and the
    next decode step over what it wrote into its row, equal transformers' forward on that chunk alone
    (exact mode)."""
    plan = exact_plan() if kernels == "cpu kernels" else exact_plan().without_cpu_kernels()
    runner = ModelRunner(
        load_model(model_dir, "cpu", torch.float32),
        3,
        64,
        plan,
        load_kernels(Path(MODEL_CACHE)) if kernels == "cpu kernels" else None,
    )
    reference = load_model(model_dir, "cpu", torch.float32)
    chunks = [text_ids[:6], text_ids[100:118], text_ids[200:241]]  # prompts of 5, 17 and 40, and a next token
    with torch.inference_mode():
        together = runner.prefill([0, 1, 2], [c[:-1] for c in chunks], [0, 0, 0])
        decoded = runner.decode([0, 1, 2], [c[-1] for c in chunks], [5, 17, 40])
        for i, chunk in enumerate(chunks):
            logits = reference(torch.tensor([chunk])).logits[0]
            assert (together[i] - logits[-2]).abs().max() < 1e-3
            assert (decoded[i] - logits[-1]).abs().max() < 1e-3


def test_a_rows_logits_do_not_depend_on_the_batch_or_how_its_prompt_was_chunked(model_dir, text_ids):
    """The default mode is batch-invariant: a prompt's logits, and its next decode steps, are bit for bit the
    same alone in one row as among other rows of other lengths, in one chunk or several, after a prefix its
    row decoded earlier or one copied from another row. Every row's inputs to the quantized linears are rounded
    to int8 and multiplied in integers whatever the row count, and attention runs one query at a time over its
    own row in prefill and decode alike."""
    plan = plan_for()
    assert plan.int8_inputs and plan.batch_dtype is None
    runner = ModelRunner(load_model(model_dir, "cpu", torch.float32), 8, 256, plan, load_kernels(Path(MODEL_CACHE)))
    prompt, others = text_ids[:30], [text_ids[100:141], text_ids[200:205], text_ids[300:320]]

    def steps(rows: list[int], chunks: list[list[int]], mine: int) -> list[torch.Tensor]:
        logits = runner.prefill(rows, chunks, [0] * len(rows))
        out, positions = [logits[mine]], [len(c) for c in chunks]
        for _ in range(4):
            logits = runner.decode(rows, [int(v.argmax()) for v in logits], positions)
            out.append(logits[mine])
            positions = [p + 1 for p in positions]
        return out

    with torch.inference_mode():
        alone = steps([5], [prompt], 0)
        together = steps([0, 1, 2, 3], [others[0], prompt, others[1], others[2]], 1)
        whole = runner.prefill([6], [prompt], [0])[0]
        runner.prefill([7], [prompt[:17]], [0])
        chunked = runner.prefill([7], [prompt[17:]], [17])[0]
        runner.prefill([4], [prompt[:10]], [0])
        for i in range(10, 29):  # positions 10..28 written by the decode step
            runner.decode([4], [prompt[i]], [i])
        after_decode = runner.prefill([4], [prompt[29:]], [29])[0]
        runner.copy_prefix(6, 2, 24)
        copied = runner.prefill([2], [prompt[24:]], [24])[0]
    assert all(torch.equal(a, t) for a, t in zip(alone, together))
    for logits in (whole, chunked, after_decode, copied):
        assert torch.equal(logits, alone[0])
