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


def test_a_nomic_bert_file_embeds_as_llama_cpp():
    """nomic-embed-text's family (fused qkv, rotary positions, SwiGLU), through pre-flight and the engine; its
    context is the file's 2,048 tokens (no learned position table bounds it)."""
    name = "nomic-bert-q8_0.gguf"
    with LLM(GGUF_DIR / name, model_cache_dir=MODEL_CACHE) as llm:
        vectors = np.array(llm.embed(REF["texts"]))
        assert (vectors * np.array(REF["files"][name]["vectors"])).sum(1).min() > 0.999
        assert len(llm.embed("word " * 1000)[0]) == 64
        with pytest.raises(ParameterError, match="at most 2048"):
            llm.embed("word " * 2100)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_a_generating_models_embedding_is_llama_cpps(pooling):
    """The embedded SmolLM2 file with --embedding: its token vectors pooled as llama-server --embedding pools them,
    each within cosine 0.999 (the plan keeps float inputs here: int8 ones gave 0.994 on the first text)."""
    ref = json.loads((GGUF_DIR / "smollm2-embeddings-llamacpp.json").read_text())
    with LLM(model_cache_dir=MODEL_CACHE, embedding=True, pooling=pooling, rows=4, skip_preflight=True) as llm:
        vectors = np.array(llm.embed(ref["texts"]))
    cosine = (vectors * np.array(ref["pooling"][pooling])).sum(1)
    assert cosine.min() > 0.999, cosine


def test_rerank_scores_as_llama_cpp():
    ref = REF["rerank"]
    with LLM(GGUF_DIR / ref["file"], model_cache_dir=MODEL_CACHE, skip_preflight=True) as llm:
        scores = llm.rerank(ref["query"], ref["documents"])
    assert max(abs(a - b) for a, b in zip(scores, ref["scores"])) < 1e-2


def test_the_jsonl_job_embeds_each_line_and_resumes(tmp_path):
    import subprocess
    import sys

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"input": t, "id": i} for i, t in enumerate(REF["texts"])] + [{"input": "word " * 400}, {"nope": 1}]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "inference_api.offline.generate",
        str(src),
        str(out),
        "--model",
        str(GGUF_DIR / "bert-q8_0.gguf"),
        "--model-cache-dir",
        MODEL_CACHE,
        "--skip-preflight",
        "--no-progress",
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["line"] for r in records] == list(range(1, len(lines) + 1))
    vectors = np.array([r["embedding"] for r in records[: len(REF["texts"])]])
    assert (vectors * np.array(REF["files"]["bert-q8_0.gguf"]["vectors"])).sum(1).min() > 0.999
    assert "at most 128" in records[-2]["error"] and "input" in records[-1]["error"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)  # all answered: nothing appended
    assert len(out.read_text().splitlines()) == len(lines)
