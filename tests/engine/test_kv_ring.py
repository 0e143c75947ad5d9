"""Sliding-window layers in rings of window + prefill chunk slots (as llama.cpp keeps its SWA layers): the same
numbers as a cache as long as the context, past the ring's wrap, in prefill chunks and decode steps, and a prefix
reused only while the row still holds the window before it. The tiny Gemma 3 file (6 layers, window 16) from
tests/data/gguf, served as the server serves it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch
from servers import MODEL_CACHE, ROOT

from inference_api.config import ServerConfig
from inference_api.engine.kv_cache import RowKVCache
from inference_api.engine.messages import GenerateRequest, SamplingParams
from inference_api.engine.process import build_engine

GEMMA3 = ROOT / "tests" / "data" / "gguf" / "gemma3-q4_k_m.gguf"
CHUNK = 24  # the prefill chunk: rings of 16 + 24 = 40 slots in a context of 256


def serve(**flags):
    return build_engine(
        ServerConfig(
            model=str(GEMMA3),
            model_cache_dir=Path(MODEL_CACHE),
            rows=4,
            context_length=256,
            prefill_chunk=CHUNK,
            **flags,
        )
    )[0]


@pytest.fixture(scope="module")
def engine():
    return serve()


def full_cache(runner) -> RowKVCache:
    """The same runner's cache geometry with every layer as long as the context (no rings)."""
    c = runner.cache
    return RowKVCache(
        len(c.keys), c.keys[0].shape[0], c.keys[0].shape[1], c.length, c.keys[0].shape[3], c.dtype, runner.device
    )


def test_the_sliding_layers_keep_rings_and_the_others_the_context(engine):
    cache = engine.runner.cache
    windows = engine.runner.model.spec.windows
    assert [n for n, w in zip(cache.layer_slots, windows) if w] == [16 + CHUNK] * sum(1 for w in windows if w)
    assert [n for n, w in zip(cache.layer_slots, windows) if not w] == [256] * sum(1 for w in windows if not w)
    assert cache.nbytes < full_cache(engine.runner).nbytes / 2


def test_a_ring_gives_the_numbers_of_a_cache_as_long_as_the_context(engine):
    runner = engine.runner
    ids = [(i * 37 + 11) % 200 + 3 for i in range(200)]
    ringed = runner.score(1, ids)  # in pieces of one prefill chunk: the ring wraps four times
    rings = runner.cache
    try:
        runner.cache = full_cache(runner)
        assert runner.cache.chunk == 0
        whole = runner.score(1, ids)  # one forward, every position kept
        runner.prefill([0], [ids[:150]], [0])
        full_steps = [runner.decode([0], [t], [150 + i]) for i, t in enumerate(ids[150:])]
    finally:
        runner.cache = rings
    assert torch.equal(ringed, whole)
    for start in range(0, 150, CHUNK):  # as the scheduler prefills: a chunk at a time
        runner.prefill([0], [ids[start : min(start + CHUNK, 150)]], [start])
    ring_steps = [runner.decode([0], [t], [150 + i]) for i, t in enumerate(ids[150:])]
    assert all(torch.equal(a, b) for a, b in zip(ring_steps, full_steps))


def test_a_prefix_is_reused_only_while_the_ring_still_holds_the_window_before_it(engine):
    holds = engine.runner.holds
    assert holds(40, 5)  # the ring still holds every position written
    assert holds(100, 90) and holds(100, 76) and not holds(100, 75)  # 100 - 40 positions gone: 60 <= 76 - 16
    assert not holds(200, 20)

    def answer(engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
        out = defaultdict(list)
        for sid, prompt in prompts.items():
            engine.add(
                GenerateRequest(sid, tuple(prompt), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
            )
            while engine.has_work:
                for event in engine.step():
                    out[event.session_id].extend(event.token_ids)
        return dict(out)

    long = [(i * 13 + 5) % 150 + 3 for i in range(180)]
    short = long[:30] + [7, 8, 9]  # shares 30 tokens with a row that then wrote 192 positions
    again = long + [4, 5]  # shares all of them: the window before position 180 is still in the ring
    alone = {sid: answer(serve(), {sid: p})[sid] for sid, p in (("short", short), ("again", again))}
    hits = engine.stats.prefix_hit_tokens
    both = answer(engine, {"long": long, "again": again, "short": short})  # one after another, row 0 each time
    assert both["short"] == alone["short"] and both["again"] == alone["again"]
    assert engine.stats.prefix_hit_tokens - hits == len(long)  # "again" reused; "short" computed in full
