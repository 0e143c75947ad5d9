"""The models a server serves (after llama-server's router and vLLM's ``OpenAIServingModels``): the first model,
started with the server, and every other one from ``--model`` given again or a GGUF in ``--models-dir``, each an
engine process of its own, started when a request first names it.

A request's ``model`` picks its slot (``ModelPool.acquire``); a slot not loaded is loaded then, pre-flight first,
while the request waits (up to ``--model-load-timeout``), and other models' streams go on (each engine is its own
process). Before a load, idle models are unloaded, least recently used first, until the pre-flight estimate fits
the free memory or ``--models-max`` (0: no cap); ``--idle-unload-seconds`` unloads a model nobody used for that
long. The first model stays loaded: model-less routes (TGI's ``/generate``, shortfin's) and ``/health`` speak for
it. A model that fails to load fails its own requests (503, with the reason), never another model's.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from ..config import ServerConfig
from ..engine.client import EngineClient
from ..engine.preflight import Estimate, PreflightError, check_servable, estimate, free_memory
from ..model.loader import model_name
from ..request.prepare import PLACEHOLDER_MODELS
from ..request_errors import ModelNotFound, Unavailable

log = logging.getLogger(__name__)

RETRY_FAILED = 30  # seconds before a model that failed to load is tried again
_SPLIT = re.compile(r"-(\d+)-of-\d+$")  # a split GGUF's parts: the first one names the model


@dataclass(eq=False)
class ModelSlot:
    """One servable model: its config (the server's, with this model), and its engine while loaded."""

    name: str
    config: ServerConfig
    default: bool = False  # the first model: started with the server, never unloaded
    client: EngineClient | None = None
    estimate: Estimate | None = None  # pre-flight's, at the latest load
    failure: str | None = None  # why the latest load failed (None: it did not)
    failed_at: float = 0.0
    loaded_at: float | None = None  # monotonic: when its engine reported ready
    started_at: float | None = None  # monotonic: when its latest load began
    load_seconds: float | None = None  # from start to ready, at the latest load
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one load or unload at a time

    @property
    def state(self) -> str:
        """unloaded | loading | loaded | failed (llama-server's words)."""
        client = self.client
        if client is None:
            return "failed" if self.failure else "unloaded"
        if client.ready is not None:
            return "loaded"
        return "failed" if client.failure is not None else "loading"

    @property
    def busy(self) -> bool:
        return self.client is not None and self.client.open_sessions > 0

    def describe(self) -> dict:
        """Its state for /v1/models and /health: loaded or not, its memory (pre-flight's estimate)."""
        ready = self.client.ready if self.client is not None else None
        out: dict = {"value": self.state}
        if self.estimate is not None:
            out["memory_bytes"] = self.estimate.needed_bytes
        if self.load_seconds is not None:
            out["load_seconds"] = round(self.load_seconds, 3)
        if ready is not None:
            out["context_length"] = ready.context_length
            out["task"] = ready.task
        failure = self.failure or (self.client.failure if self.client is not None else None)
        if failure:
            out["failed"] = True
            out["message"] = failure
        return out


def model_files(folder: Path) -> Iterator[Path]:
    """The GGUF files of a models folder: each ``*.gguf`` in it, and in its subfolders one level down (a split
    file by its first part)."""
    if not folder.is_dir():
        return
    for path in sorted([*folder.glob("*.gguf"), *folder.glob("*/*.gguf")]):
        part = _SPLIT.search(path.stem)
        if path.is_file() and (part is None or int(part.group(1)) == 1):
            yield path


class ModelPool:
    """Every model the server serves, by name; ``acquire`` gives a request its model's engine, loading it."""

    def __init__(
        self,
        config: ServerConfig,
        first: EngineClient,
        first_estimate: Estimate | None = None,
        start: Callable[[ServerConfig, Callable[[], object]], EngineClient] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self._start = start or (lambda cfg, give_up: EngineClient(cfg, on_give_up=give_up).start())
        self._clock = clock
        self._lock = threading.Lock()
        self.default = ModelSlot(model_name(config), config, True, first, first_estimate, loaded_at=clock())
        self._slots: dict[str, ModelSlot] = {self.default.name: self.default}
        self._paths: set[Path] = set()  # the files already named (the first model's among them)
        if config.model and config.model.endswith(".gguf"):
            self._paths.add(Path(config.model).resolve())
        for spec in config.models:
            self._add(Path(spec))
        self.scan()
        self._stopping = threading.Event()
        if config.idle_unload_seconds > 0:
            threading.Thread(target=self._reap, name="model-reaper", daemon=True).start()

    # the names
    def scan(self) -> None:
        """Take in the models folder's files not yet known (a file added later becomes a model at the next
        listing or at the first request for it)."""
        if self.config.models_dir is not None:
            for path in model_files(Path(self.config.models_dir)):
                self._add(path)

    def _add(self, path: Path) -> None:
        resolved = path.resolve()
        with self._lock:
            if resolved in self._paths:
                return
            self._paths.add(resolved)
            name = path.stem if path.suffix == ".gguf" else path.name
            if name in self._slots:  # two files of one name: the later one by its folder too
                name = f"{path.parent.name}/{name}"
            cfg = dataclasses.replace(
                self.config,
                model=str(path),
                served_model_name=None,
                draft_model=None,  # (the first model's draft; another model drafts by prompt lookup)
                prompt_cache_dir=None
                if self.config.prompt_cache_dir is None
                else Path(self.config.prompt_cache_dir) / re.sub(r"[^\w.-]", "_", name),
            )
            self._slots[name] = ModelSlot(name, cfg)

    @property
    def several(self) -> bool:
        return len(self._slots) > 1

    def slots(self) -> list[ModelSlot]:
        self.scan()
        with self._lock:
            return list(self._slots.values())

    def slot(self, name: str, placeholders: bool = False) -> ModelSlot:
        """The slot a request's model names (a placeholder name, with ``placeholders``: the first model's);
        ModelNotFound, with the names served, for any other."""
        found, adapter = self.resolve(name, placeholders)
        if adapter is not None:
            raise ModelNotFound(f"{name!r} is a LoRA adapter of {found.name!r}, not a model", "model")
        return found

    def resolve(self, name: str, placeholders: bool = False) -> tuple[ModelSlot, str | None]:
        """The model a request names and the LoRA adapter, if it names one: ``base:adapter`` (an adapter of any
        model), or an adapter's own name (one of the first model's, which --lora loads); ModelNotFound for a name
        that is neither (whether the adapter is loaded is the caller's check, once the model is)."""
        if placeholders and name in PLACEHOLDER_MODELS:
            return self.default, None
        for attempt in range(2):
            found = self._slots.get(name)
            if found is not None:
                return found, None
            base, _, adapter = name.rpartition(":")
            if base in self._slots and adapter:
                return self._slots[base], adapter
            first = self.default.client
            if first is not None and any(a.name == name for a in first.adapters):
                return self.default, name
            if not attempt:
                self.scan()
        names = ", ".join(repr(n) for n in self._slots)
        raise ModelNotFound(f"unknown model {name!r}; this server serves {names}", "model")

    # loading and unloading
    def acquire(self, slot: ModelSlot) -> EngineClient:
        """The slot's engine, loaded now if it is not (waiting up to --model-load-timeout for it to be ready):
        Unavailable (503) while it cannot be, with the reason. The first model's, as it is: it started with the
        server, and while it loads or restarts its requests get check_ready's 503 at once."""
        slot.last_used = self._clock()
        client = slot.client
        if slot.default and client is not None:
            return client
        if client is None or client.failure is not None:
            client = self._load(slot)
        if client.ready is None and client.failure is None:
            client.wait_settled(self.config.model_load_timeout)
            if client.ready is not None and slot.load_seconds is None:
                self._loaded(slot)
        slot.last_used = self._clock()
        return client

    def _load(self, slot: ModelSlot) -> EngineClient:
        with slot.lock:
            if slot.client is not None and slot.client.failure is None:
                return slot.client
            if slot.client is not None:  # failed: its engine is gone; tried again after RETRY_FAILED
                slot.failure, slot.failed_at, slot.client = slot.client.failure, self._clock(), None
            if slot.failure is not None and self._clock() - slot.failed_at < RETRY_FAILED:
                raise Unavailable(f"model {slot.name!r} failed to load: {slot.failure}", retry_after=RETRY_FAILED)
            try:
                check_servable(slot.config)
                needed = estimate(slot.config)
            except PreflightError as exc:
                return self._failed(slot, str(exc))
            except Exception as exc:  # (the engine reports a broken file properly)
                log.warning("pre-flight for model %s skipped: %s", slot.name, exc)
                needed = None
            slot.estimate = needed
            self._make_room(slot, needed)
            log.info("loading model %s (%s)", slot.name, slot.config.model)
            slot.failure, slot.load_seconds, slot.loaded_at = None, None, None
            slot.started_at = self._clock()
            slot.client = self._start(slot.config, lambda: self.unload(slot.name, force=True))
            return slot.client

    def _loaded(self, slot: ModelSlot) -> None:
        now = self._clock()
        slot.loaded_at = now
        slot.load_seconds = now - (slot.started_at or now)
        log.info("model %s loaded in %.2f s", slot.name, slot.load_seconds)

    def _failed(self, slot: ModelSlot, message: str) -> NoReturn:
        slot.failure, slot.failed_at = message, self._clock()
        raise Unavailable(f"model {slot.name!r} cannot be loaded: {message}", retry_after=RETRY_FAILED)

    def _make_room(self, slot: ModelSlot, needed: Estimate | None) -> None:
        """Unload idle models, least recently used first, until the new one's estimate fits the free memory and
        the loaded count is under --models-max; Unavailable when busy models leave no room."""
        cap = self.config.models_max

        def short() -> str | None:
            loaded = [s for s in self._slots.values() if s.client is not None and s is not slot]
            if cap > 0 and len(loaded) >= cap:
                return f"{len(loaded)} models loaded (--models-max {cap})"
            if needed is not None:
                free = free_memory(needed.device)
                if free is not None and needed.needed_bytes > free:
                    return (
                        f"it needs {needed.needed_bytes / 2**30:.2f} GiB of {needed.memory_kind}, "
                        f"{free / 2**30:.2f} GiB free"
                    )
            return None

        while (why := short()) is not None:
            idle = sorted(
                (s for s in self._slots.values() if s.client is not None and not s.default and not s.busy),
                key=lambda s: s.last_used,
            )
            idle = [s for s in idle if s is not slot]
            if not idle:
                if needed is not None and cap <= 0 and self.config.skip_preflight:
                    return
                raise Unavailable(
                    f"model {slot.name!r} cannot be loaded now: {why}, and every other loaded model is in use "
                    f"or the first one",
                    retry_after=10,
                )
            self.unload(idle[0].name)

    def unload(self, name: str, force: bool = False) -> bool:
        """Stop a model's engine (not the first model's, not one with open requests unless ``force``); whether
        one was stopped."""
        slot = self._slots.get(name)
        if slot is None or slot.default or slot.client is None or (slot.busy and not force):
            return False
        client, slot.client = slot.client, None
        if force and client.failure:
            slot.failure, slot.failed_at = client.failure, self._clock()
        slot.loaded_at = None
        log.info("unloading model %s", name)
        threading.Thread(target=client.shutdown, name=f"unload-{name}", daemon=True).start()
        return True

    def _reap(self) -> None:
        every = max(0.2, min(5.0, self.config.idle_unload_seconds / 4))  # a few checks within the idle time
        while not self._stopping.wait(every):
            self.unload_idle()

    def unload_idle(self) -> list[str]:
        """Unload the models nobody used for --idle-unload-seconds; their names."""
        now, limit = self._clock(), self.config.idle_unload_seconds
        idle = [s.name for s in self.slots() if s.client is not None and not s.busy and now - s.last_used >= limit]
        return [name for name in idle if self.unload(name)]

    # the server's life
    def clients(self) -> list[EngineClient]:
        return [s.client for s in self.slots() if s.client is not None]

    @property
    def open_sessions(self) -> int:
        return sum(c.open_sessions for c in self.clients())

    def abort_all(self, message: str) -> int:
        return sum(c.abort_all(message) for c in self.clients())

    def shutdown(self) -> None:
        self._stopping.set()
        for client in self.clients():
            client.shutdown()
