"""The model pool's decisions (web/models.py) without engine processes: names and placeholders, loading on
demand, the least recently used idle model unloaded for --models-max, busy and first models kept, idle unload,
a failed load retried only after a while. The real engines: tests/api/test_models_real.py."""

from __future__ import annotations

import dataclasses

import pytest

from inference_api.config import ServerConfig
from inference_api.engine.messages import EngineReady
from inference_api.request_errors import ModelNotFound, Unavailable
from inference_api.web.models import RETRY_FAILED, ModelPool, model_files


class FakeClient:
    """An engine client's face: ready at once (or failed), open sessions as set, shut down when told."""

    def __init__(self, config: ServerConfig, failure: str | None = None):
        self.config = config
        self.failure = failure
        self.ready = None if failure else EngineReady("", config.model or "", 64, 10, "cpu", "float32")
        self.open_sessions = 0
        self.stopped = False
        self.adapters = ()

    def shutdown(self) -> None:
        self.stopped = True

    def abort_all(self, message: str) -> int:
        return self.open_sessions


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pool_of(tmp_path, names=("a", "b", "c"), fail=(), **flags):
    for name in names:
        (tmp_path / f"{name}.gguf").write_bytes(b"")
    config = ServerConfig(models_dir=str(tmp_path), skip_preflight=True, **flags)
    started: list[FakeClient] = []

    def start(cfg, give_up):
        client = FakeClient(cfg, "it broke" if any(cfg.model.endswith(f"{n}.gguf") for n in fail) else None)
        started.append(client)
        return client

    clock = Clock()
    pool = ModelPool(config, FakeClient(config), start=start, clock=clock)  # type: ignore[arg-type]
    return pool, started, clock


@pytest.fixture(autouse=True)
def no_preflight(monkeypatch):
    """The empty files stand for models: no pre-flight reads them."""
    monkeypatch.setattr("inference_api.web.models.check_servable", lambda config: None)
    monkeypatch.setattr("inference_api.web.models.estimate", lambda config: None)


def test_names_placeholders_and_unknown(tmp_path):
    pool, started, _ = pool_of(tmp_path)
    assert [s.name for s in pool.slots()] == ["SmolLM2-135M-Instruct", "a", "b", "c"]
    assert pool.slot("tgi", placeholders=True) is pool.default and pool.slot("dummy", True) is pool.default
    with pytest.raises(ModelNotFound) as err:
        pool.slot("tgi")
    assert "'a', 'b', 'c'" in err.value.message and err.value.field == "model"
    assert started == []  # nothing loads until asked
    (tmp_path / "d.gguf").write_bytes(b"")  # a file added later is a model at once
    assert pool.slot("d").name == "d" and pool.slot("d").state == "unloaded"


def test_loads_on_demand_and_unloads_the_least_recently_used_idle_model(tmp_path):
    pool, started, clock = pool_of(tmp_path, models_max=3)
    for name in ("a", "b"):
        clock.now += 1
        pool.acquire(pool.slot(name))
    assert [c.config.model.rsplit("/", 1)[1] for c in started] == ["a.gguf", "b.gguf"]
    clock.now += 1
    pool.acquire(pool.slot("a"))  # a used again: b is now the least recently used
    clock.now += 1
    pool.acquire(pool.slot("c"))
    assert {s.name: s.state for s in pool.slots()} == {
        "SmolLM2-135M-Instruct": "loaded",
        "a": "loaded",
        "b": "unloaded",
        "c": "loaded",
    }
    assert started[1].stopped or _eventually(lambda: started[1].stopped)
    # a busy model is never unloaded for another; with every other one busy, the new one waits (503)
    pool.slot("a").client.open_sessions = pool.slot("c").client.open_sessions = 1  # type: ignore[union-attr]
    with pytest.raises(Unavailable) as err:
        pool.acquire(pool.slot("b"))
    assert "--models-max 3" in err.value.message and "in use" in err.value.message
    assert pool.slot("b").state == "unloaded" and not pool.unload("a") and not pool.unload(pool.default.name)


def test_idle_models_unload_and_the_first_stays(tmp_path):
    pool, started, clock = pool_of(tmp_path, idle_unload_seconds=30)
    pool.acquire(pool.slot("a"))
    clock.now += 20
    pool.acquire(pool.slot("b"))
    clock.now += 15
    assert pool.unload_idle() == ["a"]  # b was used 15 s ago, the first model never goes
    clock.now += 15
    pool.slot("b").client.open_sessions = 1  # type: ignore[union-attr]
    assert pool.unload_idle() == []  # b is streaming
    assert pool.default.state == "loaded"
    pool.shutdown()


def test_a_failed_load_fails_its_own_requests_and_is_retried_later(tmp_path):
    pool, started, clock = pool_of(tmp_path, fail=("b",))
    client = pool.acquire(pool.slot("b"))
    assert client.failure == "it broke" and pool.slot("b").state == "failed"
    with pytest.raises(Unavailable) as err:
        pool.acquire(pool.slot("b"))  # within RETRY_FAILED: the same answer, no new engine
    assert "failed to load: it broke" in err.value.message and len(started) == 1
    pool.acquire(pool.slot("a"))  # another model loads meanwhile
    clock.now += RETRY_FAILED + 1
    pool.acquire(pool.slot("b"))  # tried again
    assert len(started) == 3 and pool.slot("a").state == "loaded"


def test_model_files_skip_later_split_parts(tmp_path):
    for name in ("x.gguf", "big-00001-of-00003.gguf", "big-00002-of-00003.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "y.gguf").write_bytes(b"")
    assert sorted(p.name for p in model_files(tmp_path)) == ["big-00001-of-00003.gguf", "x.gguf", "y.gguf"]


def test_another_model_gets_the_servers_settings_but_not_the_first_ones_own(tmp_path):
    pool, started, _ = pool_of(tmp_path, draft_model="d.gguf", served_model_name="mine", prompt_cache_dir=tmp_path)
    pool.acquire(pool.slot("a"))
    cfg = started[0].config
    assert (cfg.draft_model, cfg.served_model_name, cfg.prompt_cache_dir) == (None, None, tmp_path / "a")
    assert dataclasses.replace(cfg, model=None, draft_model="d.gguf", served_model_name="mine") == dataclasses.replace(
        pool.config, model=None, prompt_cache_dir=tmp_path / "a"
    )
    assert pool.default.name == "mine"


def _eventually(predicate, timeout: float = 5.0) -> bool:
    from servers import wait_for

    return bool(wait_for(predicate, timeout))


def test_adapter_names_resolve_to_their_model(tmp_path):
    from inference_api.engine.messages import AdapterInfo

    pool, _, _ = pool_of(tmp_path)
    pool.default.client.adapters = (AdapterInfo("qv", "/x", 4, 8.0, 100),)  # type: ignore[union-attr]
    first = pool.default.name
    assert pool.resolve("qv") == (pool.default, "qv") and pool.resolve(f"{first}:qv") == (pool.default, "qv")
    assert pool.resolve("a:other") == (pool.slot("a"), "other")  # (whether a has it: checked once it is loaded)
    with pytest.raises(ModelNotFound, match="is a LoRA adapter of"):
        pool.slot("qv")
    with pytest.raises(ModelNotFound, match="unknown model 'nope:qv'"):
        pool.resolve("nope:qv")
