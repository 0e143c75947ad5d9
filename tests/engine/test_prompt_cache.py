"""The prompt cache beyond the rows (engine/prompt_cache.py) over the mock runner, whose "cache" is a row's tokens
and whose answer echoes the prompt it holds (a wrong restore shows in the text): a returning conversation whose
row was taken is restored instead of computed, only for its own team; least recently used first out within the
budget; on disk across a restart, and a file of another model, or a damaged one, never served."""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from inference_api.engine.engine import Engine
from inference_api.engine.messages import GenerateRequest, SamplingParams
from inference_api.engine.prompt_cache import MIN_TOKENS, PromptCache, cache_bytes
from inference_api.mock.runner import MockRunner
from inference_api.mock.tokenizer import EOS, ByteTokenizer


class SpyRunner(MockRunner):
    def __init__(self, rows: int):
        super().__init__(rows, tokens_per_second=0)
        self.prefilled = 0  # prompt tokens computed

    def prefill(self, rows, chunks, starts):
        self.prefilled += sum(len(c) for c in chunks)
        return super().prefill(rows, chunks, starts)


def engine(cache: PromptCache | None, rows: int = 2) -> tuple[Engine, SpyRunner]:
    runner = SpyRunner(rows)
    eng = Engine(runner, ByteTokenizer(), rows, 8192, 256, frozenset([EOS]), prompt_cache=cache)
    return eng, runner


def run(eng: Engine, *requests: GenerateRequest) -> dict[str, str]:
    for r in requests:
        eng.add(r)
    out = defaultdict(str)
    for _ in range(5000):
        if not eng.has_work:
            return out
        for event in eng.step():
            out[event.session_id] += event.text
    raise AssertionError("engine did not finish")


def ask(sid: str, prompt: str, team: str = "a", max_tokens: int = 6) -> GenerateRequest:
    return GenerateRequest(sid, tuple(prompt.encode()), SamplingParams(temperature=0, max_tokens=max_tokens), team)


STORY = "Once upon a time " * 20  # 340 tokens: its cache is worth keeping
OTHERS = [f"A different conversation number {i}, long enough to be kept as well. " * 3 for i in range(4)]


def test_a_returning_conversation_is_restored_not_computed():
    cache = PromptCache(64 << 20)
    eng, runner = engine(cache)
    first = run(eng, ask("s1", STORY))["s1"]
    run(eng, *(ask(f"o{i}", p) for i, p in enumerate(OTHERS)))  # every row taken by others since
    assert cache.saved >= 1
    before = runner.prefilled
    again = run(eng, ask("s2", STORY + first + " And then?"))["s2"]
    computed = runner.prefilled - before
    assert computed < len(" And then?") + 12  # the conversation so far came from the prompt cache
    assert cache.restored == 1
    # the answer is the one a cold engine gives (the mock echoes what its cache holds)
    cold, _ = engine(None)
    assert again == run(cold, ask("c", STORY + first + " And then?"))["c"]


def test_another_team_never_finds_it():
    cache = PromptCache(64 << 20)
    eng, runner = engine(cache)
    run(eng, ask("s1", STORY, team="a"))
    run(eng, *(ask(f"o{i}", p, team="a") for i, p in enumerate(OTHERS)))
    before = runner.prefilled
    run(eng, ask("x", STORY + "?", team="b"))
    assert runner.prefilled - before == len(STORY) + 1 and cache.restored == 0


def test_the_least_recently_used_go_first_within_the_budget():
    one = 8 * len(OTHERS[0])  # (a snapshot of the mock: 8 bytes a token)
    cache = PromptCache(2 * one + one // 2)
    for text in OTHERS:
        cache.save("a", tuple(text.encode()), [torch.tensor(list(text.encode()), dtype=torch.int64)])
    kept = [cache.longest(tuple(t.encode()), "a", 10_000)[1] for t in OTHERS]
    # the first two went (what is found of them is the others' shared opening), the last two stay whole
    assert all(k < MIN_TOKENS for k in kept[:2]) and kept[2:] == [len(t) for t in OTHERS[2:]]
    assert cache.nbytes <= cache.budget


def test_the_budget_by_default():
    assert cache_bytes(0) == 0 and cache_bytes(100) == 100 << 20
    assert cache_bytes(-1, total_memory=64 << 30) == 4 << 30 and cache_bytes(-1, total_memory=8 << 30) == 2 << 30


def test_on_disk_it_survives_a_restart(tmp_path: Path):
    cache = PromptCache(64 << 20, tmp_path, fingerprint="model-1")
    eng, _ = engine(cache)
    first = run(eng, ask("s1", STORY))["s1"]
    eng.close()  # at shutdown every row's cache goes to the folder
    assert list(tmp_path.glob("*.kvc"))
    restarted = PromptCache(64 << 20, tmp_path, fingerprint="model-1")
    eng2, runner2 = engine(restarted)
    again = run(eng2, ask("s2", STORY + first + " Next."))["s2"]
    assert runner2.prefilled < 20 and restarted.restored == 1
    cold, _ = engine(None)
    assert again == run(cold, ask("c", STORY + first + " Next."))["c"]


def test_a_file_holds_empty_tensors_too(tmp_path: Path):
    """A snapshot of an int8 cache with float16 layers holds their empty scales ([heads, 0]): written and read back
    whole, not refused as damaged."""
    saved = [torch.arange(12, dtype=torch.int8).view(2, 6), torch.empty(2, 0, dtype=torch.float16), torch.ones(2, 3)]
    cache = PromptCache(64 << 20, tmp_path, fingerprint="model-1")
    cache.save("team", tuple(range(300)), saved)
    cache.flush()
    again = PromptCache(64 << 20, tmp_path, fingerprint="model-1")
    [key] = list(again.entries)
    got = again.load(key)
    assert got is not None and [t.shape for t in got] == [t.shape for t in saved]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, saved))


def test_another_models_files_and_damaged_ones_are_never_served(tmp_path: Path, caplog):
    cache = PromptCache(64 << 20, tmp_path, fingerprint="model-1")
    cache.save("a", tuple(STORY.encode()), [torch.tensor(list(STORY.encode()), dtype=torch.int64)])
    cache.flush()
    with caplog.at_level(logging.WARNING):
        other = PromptCache(64 << 20, tmp_path, fingerprint="model-2")
    assert not other.entries and "another version or model" in caplog.text
    (path,) = tmp_path.glob("*.kvc")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one byte of the tensors
    path.write_bytes(bytes(data))
    damaged = PromptCache(64 << 20, tmp_path, fingerprint="model-1")
    key, n = damaged.longest(tuple((STORY + "x").encode()), "a", 10_000)
    assert key is not None and n == len(STORY)  # its header reads, so it is found...
    with caplog.at_level(logging.WARNING):
        assert damaged.load(key) is None  # ...but its contents fail their checksum: not served, and forgotten
    assert "checksum" in caplog.text and not damaged.entries and not list(tmp_path.glob("*.kvc"))
    eng, runner = engine(damaged)
    run(eng, ask("s", STORY + "x"))
    assert runner.prefilled == len(STORY) + 1


@pytest.mark.parametrize("junk", [b"", b"IAPC", b"not a cache file at all"])
def test_unreadable_files_are_ignored(tmp_path: Path, junk: bytes):
    (tmp_path / "junk.kvc").write_bytes(junk)
    assert not PromptCache(64 << 20, tmp_path, fingerprint="m").entries


def test_the_budget_follows_a_containers_limit(monkeypatch):
    """A container's memory limit (the Kubernetes manifest's 3.5 GiB), not the machine's, sets the auto budget."""
    from pathlib import Path as P

    from inference_api.engine import prompt_cache

    real = P.read_text

    def read_text(self, *args, **kwargs):
        if str(self) == "/sys/fs/cgroup/memory.max":
            return str(3584 << 20)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(P, "read_text", read_text)
    assert prompt_cache.cache_bytes(-1) == min(4 << 30, prompt_cache.memory_limit() // 4) == 896 << 20


def test_two_writers_of_one_entry_leave_a_whole_file(tmp_path: Path, monkeypatch):
    """Two servers on one folder (or two saves of one prefix) write the same entry at once: each writes its own
    temporary file, so the entry left is whole and served. Here the second writer runs all through while the first
    is half-way through its bytes; a shared temporary file would leave the first's tail over the second's."""
    from inference_api.engine import prompt_cache

    tokens = tuple(STORY.encode())
    caches = [PromptCache(64 << 20, tmp_path, fingerprint="m") for _ in range(2)]
    tensors = [[torch.full((4096,), i, dtype=torch.int64)] for i in (1, 2)]
    real_open, interleaved = open, []

    class HalfThenOther:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data: bytes) -> None:
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            if not interleaved:
                interleaved.append(True)
                caches[1]._write(path, "a", tokens, tensors[1])
            self.f.write(data[len(data) // 2 :])

    def opening(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return HalfThenOther(f) if "w" in mode and not interleaved else f

    path = tmp_path / f"{prompt_cache._key('a', tokens)}{prompt_cache.SUFFIX}"
    monkeypatch.setattr(prompt_cache, "open", opening, raising=False)
    caches[0]._write(path, "a", tokens, tensors[0])
    monkeypatch.undo()
    assert interleaved and not list(tmp_path.glob("*.tmp"))
    fresh = PromptCache(64 << 20, tmp_path, fingerprint="m")
    key, n = fresh.longest(tokens + (1,), "a", 10_000)
    assert key is not None and n == len(tokens)
    loaded = fresh.load(key)
    assert loaded is not None and any(torch.equal(loaded[0], t[0]) for t in tensors)


def test_a_dead_writers_temporary_files_are_swept_at_start(tmp_path: Path):
    import os
    import time

    from inference_api.engine.prompt_cache import STALE_TMP_S

    old, fresh = tmp_path / "x.1-2.tmp", tmp_path / "y.1-2.tmp"
    old.write_bytes(b"half"), fresh.write_bytes(b"being written")
    os.utime(old, (time.time() - STALE_TMP_S - 60,) * 2)
    PromptCache(64 << 20, tmp_path, fingerprint="m")
    assert not old.exists() and fresh.exists()
