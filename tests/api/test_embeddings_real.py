"""The embedding routes over a real server of the tiny BERT GGUF (tests/data/gguf/bert-q8_0.gguf), through the JWT
proxy with the official openai client and plain HTTP for TEI's routes: vectors as llama-server gives them, every
input shape and option, errors in each API's shape, concurrent clients each getting their own vectors; and a
generating model's server refusing to embed."""

from __future__ import annotations

import base64
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
from gguf_reference import GGUF_DIR
from servers import MODEL_CACHE, ServerProcess, jwt_proxy, team_token

NAME = "bert-q8_0"
REF = json.loads((GGUF_DIR / "bert-llamacpp.json").read_text())
TEXTS = REF["texts"]
VECTORS = np.array(REF["files"][f"{NAME}.gguf"]["vectors"])


@pytest.fixture(scope="module")
def bert():
    with ServerProcess("--model", str(GGUF_DIR / f"{NAME}.gguf"), "--model-cache-dir", MODEL_CACHE) as server:
        yield server


@pytest.fixture(scope="module")
def client(bert):
    with jwt_proxy(bert.url) as proxy:
        yield openai.OpenAI(base_url=proxy.url + "/v1", api_key=team_token(), max_retries=0, timeout=60)


def test_the_openai_client_gets_llama_cpps_vectors(client):
    r = client.embeddings.create(model=NAME, input=TEXTS)
    ours = np.array([d.embedding for d in r.data])
    assert (ours * VECTORS).sum(1).min() > 0.999 and [d.index for d in r.data] == list(range(len(TEXTS)))
    assert r.usage.prompt_tokens == sum(len(t) for t in REF["files"][f"{NAME}.gguf"]["tokens"]) == r.usage.total_tokens
    one = client.embeddings.create(model=NAME, input=TEXTS[0])
    assert np.allclose(one.data[0].embedding, ours[0], atol=1e-5)
    ids = client.embeddings.create(model=NAME, input=REF["files"][f"{NAME}.gguf"]["tokens"][1])  # token ids
    assert np.allclose(ids.data[0].embedding, ours[1], atol=1e-5)


def test_base64_and_dimensions(bert):
    body = {"model": NAME, "input": TEXTS[:2], "encoding_format": "base64", "dimensions": 16}
    data = requests.post(bert.url + "/v1/embeddings", json=body, timeout=30).json()["data"]
    raw = base64.b64decode(data[0]["embedding"])
    values = np.array(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert len(values) == 16 and abs(np.linalg.norm(values) - 1) < 1e-5  # the first 16, normalized again
    expected = VECTORS[0][:16] / np.linalg.norm(VECTORS[0][:16])
    assert np.allclose(values, expected, atol=2e-2)


def test_tei_embed(bert):
    r = requests.post(bert.url + "/embed", json={"inputs": TEXTS}, timeout=30)
    assert r.status_code == 200 and (np.array(r.json()) * VECTORS).sum(1).min() > 0.999
    raw = requests.post(bert.url + "/embed", json={"inputs": TEXTS[0], "normalize": False}, timeout=30).json()[0]
    assert abs(np.linalg.norm(raw) - 1) > 1e-3  # not normalized
    long = "word " * 400
    refused = requests.post(bert.url + "/embed", json={"inputs": long}, timeout=30)
    assert refused.status_code == 422 and "at most 128" in refused.json()["error"]
    assert requests.post(bert.url + "/embed", json={"inputs": long, "truncate": True}, timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "status", "check"),
    [
        ("/v1/embeddings", {"model": NAME, "input": []}, 400, lambda b: b["error"]["param"] == "input"),
        (
            "/v1/embeddings",
            {"model": NAME, "input": "x", "encoding_format": "hex"},
            400,
            lambda b: b["error"]["param"] == "encoding_format",
        ),
        ("/v1/embeddings", {"model": NAME, "input": [[5, 99999]]}, 400, lambda b: "token ids" in b["error"]["message"]),
        ("/v1/embeddings", {"model": "other", "input": "x"}, 404, lambda b: b["error"]["code"] == "model_not_found"),
        (
            "/v1/embeddings",
            {"model": NAME, "input": "word " * 400},
            400,
            lambda b: "at most 128" in b["error"]["message"],
        ),
        ("/embed", {"inputs": 5}, 422, lambda b: b["error_type"] == "validation"),
        (
            "/v1/chat/completions",
            {"model": NAME, "messages": [{"role": "user", "content": "hi"}]},
            400,
            lambda b: "embedding model" in b["error"]["message"],
        ),
        ("/rerank", {"query": "a", "documents": ["b"]}, 400, lambda b: "not a reranker" in b["error"]["message"]),
    ],
)
def test_bad_input_in_each_apis_shape(bert, path, body, status, check):
    r = requests.post(bert.url + path, json=body, timeout=30)
    assert r.status_code == status and check(r.json()), r.text


def test_concurrent_clients_each_get_their_own_vectors(bert):
    def one(i: int) -> list[float]:
        r = requests.post(bert.url + "/embed", json={"inputs": TEXTS[i % len(TEXTS)]}, timeout=60)
        return r.json()[0]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(32)))
    for i, v in enumerate(results):
        assert np.dot(v, VECTORS[i % len(TEXTS)]) > 0.999


def test_a_generating_model_does_not_embed(mock_server, model_name):
    r = requests.post(mock_server.url + "/v1/embeddings", json={"model": model_name, "input": "x"}, timeout=30)
    assert r.status_code == 400 and "does not embed" in r.json()["error"]["message"]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _engines(server: ServerProcess) -> list[int]:
    return [
        pid
        for pid in _descendants(server.proc.pid)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def test_the_engine_process_starts_with_short_openmp_spins(bert):
    """An embedding model's engine process starts with GOMP_SPINCOUNT=10000 (process.engine_environment: libgomp
    reads it as torch loads, so the server sets it for the spawn alone)."""
    engines = _engines(bert)
    assert len(engines) == 1
    assert b"GOMP_SPINCOUNT=10000" in Path(f"/proc/{engines[0]}/environ").read_bytes().split(b"\0")


def _policies(pid: int) -> set[int]:
    """The kernel's scheduling class of each of the process's threads (the 41st field of their stat)."""
    return {int((t / "stat").read_text().rsplit(")", 1)[1].split()[38]) for t in Path(f"/proc/{pid}/task").iterdir()}


def test_the_web_worker_runs_in_the_batch_scheduling_class_and_the_engine_in_the_default(bert):
    """lifeline.scheduling_class: every thread of the gunicorn worker in SCHED_BATCH (a woken thread never preempts
    the one holding the GIL), every thread of the engine process it started back in SCHED_OTHER."""
    engines = _engines(bert)
    workers = [p for p in _descendants(bert.proc.pid) if p not in engines and p not in _descendants(engines[0])]
    workers = [p for p in workers if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(engines) == 1 and len(workers) == 1
    assert _policies(workers[0]) == {os.SCHED_BATCH}
    assert _policies(engines[0]) == {os.SCHED_OTHER}


@pytest.fixture(scope="module")
def reranker():
    path = GGUF_DIR / REF["rerank"]["file"]
    with ServerProcess("--model", str(path), "--model-cache-dir", MODEL_CACHE) as server:
        yield server


def test_rerank_in_jinas_and_teis_shapes(reranker):
    ref = REF["rerank"]
    order = sorted(range(len(ref["scores"])), key=lambda i: -ref["scores"][i])
    body = {"query": ref["query"], "documents": ref["documents"]}
    jina = requests.post(reranker.url + "/v1/rerank", json=body, timeout=30).json()
    assert [r["index"] for r in jina["results"]] == order  # best first, as llama-server orders them
    assert jina["results"][0]["document"]["text"] == ref["documents"][order[0]]
    assert all(0 < r["relevance_score"] < 1 for r in jina["results"]) and jina["usage"]["prompt_tokens"] > 0
    top = requests.post(reranker.url + "/rerank", json={**body, "top_n": 2, "return_documents": False}, timeout=30)
    assert [r["index"] for r in top.json()["results"]] == order[:2] and "document" not in top.json()["results"][0]
    tei = requests.post(
        reranker.url + "/rerank",
        json={"query": ref["query"], "texts": ref["documents"], "raw_scores": True},
        timeout=30,
    ).json()
    assert [r["index"] for r in tei] == order
    assert max(abs(r["score"] - ref["scores"][r["index"]]) for r in tei) < 1e-2  # llama-server's raw scores
    wrong = requests.post(reranker.url + "/v1/embeddings", json={"model": "x", "input": "a"}, timeout=30)
    assert wrong.status_code in (400, 404)
    bad = requests.post(reranker.url + "/rerank", json={"query": "q", "texts": []}, timeout=30)
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation"


def test_embedding_on_a_generating_model_serves_its_token_vectors(model_name):
    """--embedding (as llama-server's): the mock backend's token vectors pooled (last), normalized, through
    /v1/embeddings and /embed; its generation routes refused."""
    with ServerProcess("--mock", "--mock-tokens-per-second", "0", "--embedding", "--pooling", "last") as server:
        r = requests.post(server.url + "/v1/embeddings", json={"model": model_name, "input": ["ab", "abc"]}, timeout=30)
        data = r.json()["data"]
        assert r.status_code == 200 and [len(d["embedding"]) for d in data] == [16, 16]
        assert all(abs(np.linalg.norm(d["embedding"]) - 1) < 1e-6 for d in data)
        assert data[0]["embedding"] != data[1]["embedding"] and r.json()["usage"]["prompt_tokens"] == 5
        assert requests.post(server.url + "/embed", json={"inputs": "ab"}, timeout=30).json()[0] == data[0]["embedding"]
        chat = {"model": model_name, "messages": [{"role": "user", "content": "hi"}]}
        refused = requests.post(server.url + "/v1/chat/completions", json=chat, timeout=30)
        assert refused.status_code == 400 and "--embedding" in refused.json()["error"]["message"]
