"""Quality of the quantized default against the exact mode on the real model, in-process."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from inference_api.config import ServerConfig
from inference_api.engine.kernels import load_kernels
from inference_api.engine.model_runner import ModelRunner, Precision
from inference_api.model_loader import load_model, pick_precision
from servers import MODEL_CACHE

TEXT = Path(__file__).with_name("data") / "english.txt"
CHUNK = 128  # fed through the row cache in prefill chunks, so later chunks read earlier ones back


def perplexity(model_dir: Path, precision: Precision, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each next token, every chunk attending to the cache."""
    runner = ModelRunner(load_model(model_dir, "cpu", torch.float32), 1, len(ids) + 1, precision,
                         load_kernels(Path(MODEL_CACHE)))
    nll = 0.0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, CHUNK):
            chunk = ids[start:start + CHUNK]
            positions = torch.arange(start, start + len(chunk))[None]
            visible = torch.arange(start + len(chunk))[None, None, :] <= positions[..., None]
            runner.cache.bind(torch.tensor([0]), positions, start + len(chunk))
            logits = runner.model.forward(torch.tensor([chunk]), positions, visible, runner.cache, last_only=False)
            targets = torch.tensor(ids[start + 1:start + len(chunk) + 1])
            lp = torch.log_softmax(logits[0, :len(targets)].float(), dim=-1)
            nll -= float(lp.gather(1, targets[:, None]).sum())
    return math.exp(nll / (len(ids) - 1))


@pytest.fixture(scope="module")
def text_ids(hf_tokenizer) -> list[int]:
    ids = hf_tokenizer.encode(TEXT.read_text())
    assert len(ids) > 900
    return ids


def test_quantized_default_perplexity_is_within_two_percent_of_exact(model_dir, text_ids):
    precision = pick_precision(ServerConfig(), "cpu", torch.float32)
    # the embedded Q4_1 GGUF keeps its 4-bit blocks; the cache is int8
    assert (precision.quantize, precision.kv_dtype) == ("int4", torch.int8)
    exact = perplexity(model_dir, Precision(), text_ids)
    default = perplexity(model_dir, precision, text_ids)
    matmuls = str(precision.batch_dtype or torch.float32).removeprefix("torch.")
    print(f"\nperplexity on {len(text_ids)} tokens: exact {exact:.3f}, default ({precision.quantize} weights, "
          f"int8 KV cache, {matmuls} multi-row matmuls) {default:.3f} ({(default / exact - 1) * 100:+.2f} %)")
    assert exact < 40  # the model reads English: a broken forward gives hundreds or thousands
    assert default <= exact * 1.02
