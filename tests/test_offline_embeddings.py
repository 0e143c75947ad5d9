"""The offline API's embed() and rerank(): the tiny random BERT and cross-encoder of tests/data/gguf, the same
numbers as llama-server's (and as /v1/embeddings'), and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf_reference import GGUF_DIR
from servers import MODEL_CACHE

from inference_api import LLM
from inference_api.offline.llm import ParameterError

REF = json.loads((GGUF_DIR / "bert-llamacpp.json").read_text())


def test_embed_gives_llama_cpps_vectors():
    with LLM(GGUF_DIR / "bert-q8_0.gguf", model_cache_dir=MODEL_CACHE, skip_preflight=True) as llm:
        vectors = np.array(llm.embed(REF["texts"]))
        assert (vectors * np.array(REF["files"]["bert-q8_0.gguf"]["vectors"])).sum(1).min() > 0.999
        raw = llm.embed("hello", normalize=False)[0]
        assert abs(np.linalg.norm(raw) - 1) > 1e-3
        with pytest.raises(ParameterError, match="at most 128"):
            llm.embed("word " * 400)
        assert len(llm.embed("word " * 400, truncate=True)[0]) == 64
        with pytest.raises(ParameterError, match="not a reranker"):
            llm.rerank("q", ["d"])


def test_rerank_scores_as_llama_cpp():
    ref = REF["rerank"]
    with LLM(GGUF_DIR / ref["file"], model_cache_dir=MODEL_CACHE, skip_preflight=True) as llm:
        scores = llm.rerank(ref["query"], ref["documents"])
    assert max(abs(a - b) for a, b in zip(scores, ref["scores"])) < 1e-2
