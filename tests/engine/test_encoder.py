"""Embedding models from a GGUF (model/encoder.py, gguf_vocab.wpm_backend) against llama.cpp: the tiny random BERT
of tests/data/gguf at F32, F16 and Q8_0, DistilBERT and nomic-bert (scripts/make_embedding_ggufs.py), each text
tokenized as llama-server tokenizes it and each vector within cosine 0.999 of llama-server --embedding's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf_reference import GGUF_DIR
from servers import MODEL_CACHE

from inference_api.config import ServerConfig
from inference_api.engine.embedder import SHARED_STEP_TOKENS, Embedder
from inference_api.engine.messages import EmbedRequest, FinishReason, GenerateRequest, SamplingParams
from inference_api.engine.plan import LEVELS, cpu_flags
from inference_api.model.encoder import BertEncoder
from inference_api.model.gguf_vocab import gguf_tokenizer

REFERENCE = json.loads((GGUF_DIR / "bert-llamacpp.json").read_text())


@pytest.mark.parametrize("name", sorted(REFERENCE["files"]))
def test_tokens_and_vectors_are_llama_cpps(name):
    ref = REFERENCE["files"][name]
    tok, _ = gguf_tokenizer(GGUF_DIR / name, "bert")
    ids = [tok.encode(t) for t in REFERENCE["texts"]]
    assert ids == ref["tokens"]
    model = BertEncoder(GGUF_DIR / name)
    assert model.pooling == "mean" and model.dims == len(ref["vectors"][0])
    ours = torch.nn.functional.normalize(model.forward(ids), dim=-1)
    cosine = (ours * torch.tensor(ref["vectors"])).sum(-1)
    assert bool((cosine > 0.999).all()), cosine


def test_an_inputs_vector_is_the_same_whatever_shares_its_forward():
    model = BertEncoder(GGUF_DIR / "bert-q8_0.gguf")
    ids = REFERENCE["files"]["bert-q8_0.gguf"]["tokens"]
    alone = [model.forward([i])[0] for i in ids]
    together = model.forward(ids)
    for a, b in zip(alone, together):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("dims", [32, 12])  # 12: no whole vector of floats, the scalar loops
def test_the_kernels_encoder_attention_is_sdpa_over_each_input_alone(kernels, dims):
    """encoder_attention over inputs packed one after another (rows of q, k and v views of one qkv output, as the
    encoder passes them): each input's rows those of torch's SDPA over that input alone, and the same to the bit
    whatever is packed beside it; an empty input is allowed."""
    torch.manual_seed(0)
    heads, lengths = 3, [1, 7, 0, 70, 16]  # 70: two blocks of queries
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    qkv = torch.randn(offsets[-1], 3 * heads * dims)
    q, k, v = qkv.split(heads * dims, dim=1)
    got = kernels.encoder_attention(q, k, v, torch.tensor(offsets), heads, dims**-0.5)
    assert got.shape == (offsets[-1], heads * dims)
    for start, end in zip(offsets, offsets[1:]):
        if start == end:
            continue
        qi, ki, vi = (t[start:end].reshape(1, end - start, heads, dims).transpose(1, 2) for t in (q, k, v))
        want = F.scaled_dot_product_attention(qi, ki, vi).transpose(1, 2).reshape(end - start, -1)
        torch.testing.assert_close(got[start:end], want, rtol=1e-5, atol=1e-6)
        alone = kernels.encoder_attention(
            q[start:end], k[start:end], v[start:end], torch.tensor([0, end - start]), heads, dims**-0.5
        )
        assert torch.equal(alone, got[start:end])
    with pytest.raises(RuntimeError, match="offsets"):
        kernels.encoder_attention(q, k, v, torch.tensor([0, 5]), heads, dims**-0.5)


@pytest.mark.parametrize("name", ["bert-q8_0.gguf", "nomic-bert-q8_0.gguf", "bert-rerank-f32.gguf"])
def test_an_encoder_on_the_kernels_gives_torchs_numbers_and_each_input_its_own(kernels, name):
    """The encoder as the server builds it (linears and attention on the kernels) against torch's alone, inputs of
    different lengths packed together; a quantized file's vector of each input the same to the bit alone or beside
    others (nomic-bert: rotary positions counted within each input; a float file's linears are torch's dense ones,
    whose sums may follow the rows' count)."""
    from inference_api.engine.plan import INT8_LAYOUT
    from inference_api.model.linear import linear_factory

    torch.manual_seed(1)
    inputs = [torch.randint(1, 512, (n,)).tolist() for n in (3, 25, 1, 100, 9)]
    make_linear = linear_factory(torch.device("cpu"), torch.float32, "int8", kernels, None, True)
    model = BertEncoder(GGUF_DIR / name, make_linear, INT8_LAYOUT, kernels)
    together = model.forward(inputs)
    dense = BertEncoder(GGUF_DIR / name).forward(inputs)  # torch's attention, the linears' inputs in float
    if model.scores:  # a float file: float linears on both sides
        torch.testing.assert_close(together, dense, rtol=1e-4, atol=1e-5)
    else:  # int8 inputs against float ones
        assert bool((F.cosine_similarity(together, dense) > 0.999).all())
    for i, ids in enumerate(inputs):
        alone = model.forward([ids])[0]
        assert torch.equal(alone, together[i]) if "q8_0" in name else torch.allclose(alone, together[i], atol=1e-5)


def test_the_embedder_takes_requests_in_turn_and_refuses_generation():
    model = BertEncoder(GGUF_DIR / "bert-q8_0.gguf")
    ids = [tuple(i) for i in REFERENCE["files"]["bert-q8_0.gguf"]["tokens"]]
    eng = Embedder(model, batch_tokens=64)
    eng.embed(EmbedRequest("big", tuple(ids * 10)))
    eng.embed(EmbedRequest("small", (ids[2],)))
    first = eng.step()
    assert any(e.session_id == "small" for e in first)  # not behind the 40 inputs of "big"
    events = first
    while eng.has_work:
        events += eng.step()
    assert sorted(e.index for e in events if e.session_id == "big") == list(range(40))
    eng.add(GenerateRequest("gen", (1, 2), SamplingParams()))
    (refused,) = eng.step()
    assert refused.finish_reason is FinishReason.ERROR and "embedding model" in (refused.error or "")


def test_several_requests_run_a_forward_of_one_thread_on_each_core(kernels):
    """One request's inputs take one forward on every configured thread; while several requests are open (many
    clients, whose tokens and JSON the one web worker makes) the step's inputs are split in order between the
    cores, each part a forward of one thread of its own, all at once (the kernels let go of the GIL), and each
    input's vector is the one it has alone, to the bit."""
    import threading

    from inference_api.engine.plan import INT8_LAYOUT
    from inference_api.model.linear import linear_factory

    make_linear = linear_factory(torch.device("cpu"), torch.float32, "int8", kernels, None, True)
    model = BertEncoder(GGUF_DIR / "bert-q8_0.gguf", make_linear, INT8_LAYOUT, kernels)
    ids = [tuple(i) for i in REFERENCE["files"]["bert-q8_0.gguf"]["tokens"]]
    alone = {i: model.forward([list(x)])[0] for i, x in enumerate(ids)}
    calls = []
    forward = model.forward
    both = threading.Barrier(2, timeout=60)  # the split's two forwards pass it only when both run at once

    def recorded(inputs):
        calls.append((threading.get_ident(), torch.get_num_threads(), len(inputs)))
        if torch.get_num_threads() == 1:
            both.wait()
        return forward(inputs)

    model.forward = recorded
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        eng = Embedder(model, batch_tokens=4096)
        for sessions, forwards, threads in ((["a"], 1, 2), (["b", "c"], 2, 1), (["d"], 1, 2)):
            calls.clear()
            for sid in sessions:
                eng.embed(EmbedRequest(sid, tuple(ids), normalize=False))
            events = eng.step()
            assert not eng.has_work and len(events) == len(ids) * len(sessions)
            assert len(calls) == forwards and {n for _, n, _ in calls} == {threads}
            assert len({tid for tid, _, _ in calls}) == forwards  # each part on a thread of its own, at once
            for e in events:
                assert torch.equal(torch.from_numpy(e.vector.copy()), alone[e.index])
    finally:
        model.forward = forward
        eng.close()
        torch.set_num_threads(before)


def test_the_split_keeps_the_inputs_in_order_in_parts_of_about_equal_tokens():
    from inference_api.engine.embedder import _split

    assert _split([[1] * 5] * 6, 2) == [[[1] * 5] * 3, [[1] * 5] * 3]
    assert _split([[1] * 10, [2], [3], [4]], 2) == [[[1] * 10], [[2], [3], [4]]]
    assert _split([[1]], 2) == [[[1]]]  # never an empty part
    assert _split([[1, 1], [2, 2], [3, 3]], 3) == [[[1, 1]], [[2, 2]], [[3, 3]]]


def test_a_step_shared_by_several_requests_holds_fewer_tokens():
    """One request's inputs fill a step up to ``batch_tokens``; while several are open a step holds
    SHARED_STEP_TOKENS at most for each core's forward (short forwards, so the web worker's answers flow while the
    next one runs), inputs of each in turn."""
    model = BertEncoder(GGUF_DIR / "bert-q8_0.gguf")
    ids = [tuple(i) for i in REFERENCE["files"]["bert-q8_0.gguf"]["tokens"]] * 20
    assert sum(map(len, ids)) > 2 * SHARED_STEP_TOKENS
    eng = Embedder(model, batch_tokens=4096)
    eng.embed(EmbedRequest("one", tuple(ids)))
    assert len(eng.step()) == len(ids) and not eng.has_work
    eng.embed(EmbedRequest("a", tuple(ids)))
    eng.embed(EmbedRequest("b", tuple(ids)))
    shared = eng.step()
    assert sum(e.prompt_tokens for e in shared) <= SHARED_STEP_TOKENS * eng.threads  # each core's forward's
    assert {e.session_id for e in shared} == {"a", "b"}
    events = shared
    while eng.has_work:
        events += eng.step()
    assert sorted(e.index for e in events if e.session_id == "b") == list(range(len(ids)))


@pytest.mark.skipif(not LEVELS["avx2"][1] <= cpu_flags(), reason="the CPU runs no AVX2 level")
def test_an_embedding_models_engine_runs_the_kernels_level_asked():
    """--cpu-level reaches an embedding model's engine as it reaches a decoder's (make_plan's level), and its
    ready message names the build (/health's ``kernels``, which bench.py prints)."""
    from inference_api.engine.process import build_embedder

    gguf = GGUF_DIR / "bert-q8_0.gguf"
    config = ServerConfig(model=str(gguf), model_cache_dir=Path(MODEL_CACHE), cpu_level="avx2")
    embedder, ready = build_embedder(config, gguf)
    assert ready.task == "embed" and "avx2" in embedder.model.kernels.build and "avx2" in ready.kernels


def test_only_an_embedding_models_engine_gets_short_openmp_spins():
    from inference_api.engine.process import engine_environment

    assert engine_environment(ServerConfig(model=str(GGUF_DIR / "bert-q8_0.gguf"))) == {"GOMP_SPINCOUNT": "10000"}
    assert engine_environment(ServerConfig(model=str(GGUF_DIR / "llama-q4_k_m.gguf"))) == {}
    assert engine_environment(ServerConfig(mock=True)) == {}


def test_a_rerankers_scores_are_llama_cpps():
    """The tiny random cross-encoder (a classifier on the first token, as llama-server --reranking scores it): the
    same order, each score within 1e-2."""
    ref = REFERENCE["rerank"]
    tok, _ = gguf_tokenizer(GGUF_DIR / ref["file"], "bert")
    model = BertEncoder(GGUF_DIR / ref["file"])
    assert model.scores and model.pooling == "rank"
    ours = model.forward([tok.encode(ref["query"], d) for d in ref["documents"]])[:, 0].tolist()
    assert sorted(range(4), key=lambda i: -ours[i]) == sorted(range(4), key=lambda i: -ref["scores"][i])
    assert max(abs(a - b) for a, b in zip(ours, ref["scores"])) < 1e-2


def test_a_generating_models_token_vectors_pooled_with_embedding():
    """--embedding on a decoder (here the mock's, whose token vectors are one-hot by byte and position): each
    input computed in a row as a prompt is, in chunks, its vectors pooled (mean, last), no token sampled, its row
    freed; generation refused."""
    from inference_api.engine.engine import Engine
    from inference_api.mock.runner import MockRunner
    from inference_api.mock.tokenizer import EOS, ByteTokenizer

    def run(pooling: str, inputs) -> dict[int, list[float]]:
        eng = Engine(MockRunner(2, 0), ByteTokenizer(), 2, 4096, 8, frozenset([EOS]), pooling=pooling)
        eng.embed(EmbedRequest("e", tuple(tuple(i) for i in inputs), normalize=False))
        out = {}
        for _ in range(100):
            for event in eng.step():
                out[event.index] = event.vector.tolist()
            if not eng.has_work:
                break
        assert not eng.scheduler.running and eng.scheduler.rows.num_free == 2
        return out

    inputs = [list(range(1, 21)), [5], list(range(30, 33))]  # 20 tokens: computed in chunks of 8
    mean, last = run("mean", inputs), run("last", inputs)
    expected_last = torch.zeros(16)
    expected_last[(20 + 19) % 16] = 1.0  # token 20 at position 19
    assert last[0] == expected_last.tolist()
    expected_mean = torch.zeros(16)
    for pos, t in enumerate(inputs[0]):
        expected_mean[(t + pos) % 16] += 1 / 20
    assert torch.allclose(torch.tensor(mean[0]), expected_mean)
    assert sorted(mean) == [0, 1, 2]
    eng = Engine(MockRunner(2, 0), ByteTokenizer(), 2, 4096, 8, frozenset([EOS]), pooling="last")
    eng.add(GenerateRequest("g", (1, 2), SamplingParams()))
    (refused,) = eng.step()
    assert refused.finish_reason is FinishReason.ERROR and "--embedding" in (refused.error or "")
