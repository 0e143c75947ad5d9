"""The app's side of the engine: starts the backend process, submits requests, demultiplexes its output.

One supervisor thread starts the engine process and reads its output queue, handing each event to its
session's own queue, keyed by session id, so no request ever sees another's tokens. Sessions are removed
when they finish, fail or are abandoned. When a running engine dies, every open session fails at once and
the same thread starts a new engine (bounded restarts with backoff); past the bound the worker process
ends so gunicorn replaces it.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess
from multiprocessing.queues import Queue
from typing import Any

from ..config import ServerConfig
from ..model.tokenizer import Tokenizer
from ..request_errors import RateLimited, Unavailable
from .messages import (
    AdapterInfo,
    AdapterReply,
    CancelRequest,
    EmbedRequest,
    EngineFailed,
    EngineReady,
    EngineStats,
    FinishReason,
    GenerateRequest,
    LoadAdapter,
    SamplingParams,
    Shutdown,
    StepOutput,
    TokenEvent,
    UnloadAdapter,
)
from .metrics import Metrics
from .process import engine_environment, run_engine

log = logging.getLogger(__name__)

RESTART_WINDOW = 600.0  # seconds: engine_max_restarts counts the restarts within this window
RESTART_BACKOFF = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # seconds before the 1st, 2nd, ... restart in the window
SAVE_TIMEOUT = 60.0  # seconds a stopping engine may take to save its rows' caches to --prompt-cache-dir
ADAPTER_TIMEOUT = 300.0  # seconds a LoRA adapter's load or unload may take (the engine reads it between steps)


@dataclass(eq=False)
class Session:
    id: str
    prompt_tokens: int
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    finish_reason: FinishReason | None = None  # set by the demultiplexer when the last event arrives
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None  # monotonic time of the first generated token
    last_token_at: float | None = None  # monotonic time the latest tokens arrived
    completion_tokens: int = 0  # over every choice
    n: int = 1  # choices (SamplingParams.n): each ends with its own finished event
    finished_choices: int = 0
    choice_tokens: dict[int, int] = field(default_factory=dict)  # tokens generated per choice
    team: str | None = None  # the proxy's X-Team-Id (None: not counted per team)
    embeds: bool = False  # inputs to embed or score: one place, however many inputs (its n)

    @property
    def places(self) -> int:
        """The row-and-queue places it takes: n choices, n; inputs to embed, one."""
        return 1 if self.embeds else self.n

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class EngineClient:
    def __init__(self, config: ServerConfig, on_give_up: Callable[[], object] | None = None):
        self.config = config
        self._ctx = mp.get_context("spawn")  # a clean interpreter: no threads or locks inherited from the worker
        self._inbox: Queue[Any] | None = None  # the running engine's queues and process (None before the first)
        self._outbox: Queue[Any] | None = None
        self.process: SpawnProcess | None = None
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._settled = threading.Condition()  # notified whenever ready or failure is set, and at shutdown
        self._on_give_up = on_give_up or (lambda: os.kill(os.getpid(), signal.SIGQUIT))
        self._ready: EngineReady | None = None
        self._failure: str | None = None
        self.restarting = False
        self.restarts: list[float] = []  # monotonic times of the restarts within RESTART_WINDOW
        self.restart_count = 0  # engine restarts since the worker started
        self.tokenizer: Tokenizer | None = None
        self.stats = self._idle_stats()
        self._adapters: tuple[AdapterInfo, ...] = ()  # the engine's LoRA adapters, as its latest word says
        self._replies: dict[str, queue.SimpleQueue] = {}  # LoadAdapter / UnloadAdapter awaiting their AdapterReply
        self._loaded_at_run_time: dict[str, AdapterInfo] = {}  # loaded again into an engine that restarts
        self.metrics = Metrics(lambda: self.stats, lambda: self.open_sessions, self.ranks_alive)

    # life cycle
    def start(self) -> EngineClient:
        if getattr(mp.current_process(), "_inheriting", False):  # (multiprocessing's own test for this)
            # a spawned process importing a script that makes an engine at its top level (an offline LLM with
            # no main guard): that import would start another engine and wait on it for ever
            raise RuntimeError(
                "an engine was started while a child process imported the main script: put the code that makes "
                "the LLM under `if __name__ == '__main__':` (the engine runs in a spawned process, which imports "
                "the script again)"
            )
        # The engine is started from this long-lived thread: its parent-death signal follows the thread that
        # started it, and the thread lives as long as the worker.
        threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True).start()
        self._started.wait()
        # a program that ends without shutdown() (an offline LLM never closed) still stops its engine: the engine
        # ignores SIGTERM, so multiprocessing's exit handler, which joins its children, would wait on it for ever
        atexit.register(self.shutdown)
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine: it ends at once, or, with the prompt cache on disk, once its rows' caches are saved
        there (at most SAVE_TIMEOUT)."""
        atexit.unregister(self.shutdown)
        self._stopping.set()
        self._settle()
        process = self.process
        if process is not None and process.is_alive():
            self._send(Shutdown())
            process.join(max(timeout, SAVE_TIMEOUT) if self.config.prompt_cache_dir else timeout)
            if process.is_alive():
                process.kill()
                process.join(timeout)

    @property
    def ready(self) -> EngineReady | None:
        """The running engine's description (None while none is ready)."""
        return self._ready

    @ready.setter
    def ready(self, value: EngineReady | None) -> None:
        self._ready = value
        self._settle()

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve (None while it can or may yet)."""
        return self._failure

    @failure.setter
    def failure(self, value: str | None) -> None:
        self._failure = value
        self._settle()

    def wait_settled(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the engine is ready or has failed (or the client stops); whether
        it is ready or has failed."""
        with self._settled:
            self._settled.wait_for(
                lambda: self.ready is not None or self.failure is not None or self._stopping.is_set(), timeout
            )
        return self.ready is not None or self.failure is not None

    def _settle(self) -> None:
        with self._settled:
            self._settled.notify_all()

    @property
    def state(self) -> str:
        if self.failure is not None:
            return "failed"
        if self.ready is not None:
            return "ready"
        return "restarting" if self.restarting else "loading"

    def _spawn(self) -> tuple[SpawnProcess, Queue[Any]]:
        """Start an engine process; returns it and its output queue."""
        self._inbox, self._outbox = inbox, outbox = self._ctx.Queue(), self._ctx.Queue()
        self.process = process = self._ctx.Process(
            target=run_engine, args=(self.config, inbox, outbox), name="inference-engine", daemon=True
        )
        added = {k: v for k, v in engine_environment(self.config).items() if k not in os.environ}
        os.environ.update(added)  # (the spawned process starts with this process's environment)
        try:
            process.start()
        finally:
            for key in added:
                os.environ.pop(key, None)
        return process, outbox

    def _send(self, msg: object) -> None:
        """Put a message on the engine's input queue."""
        if self._inbox is None:
            raise Unavailable("model is loading, try again shortly", retry_after=5)
        self._inbox.put(msg)

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            try:
                process, outbox = self._spawn()
            except Exception as exc:  # no process to supervise: whoever waits on it hears why
                log.exception("the engine process could not be started")
                self.failure = f"the engine process could not be started: {exc}"
                self._started.set()
                return
            self._started.set()
            served = self._demux(process, outbox)
            if self._stopping.is_set() or not served:
                return  # shutting down, or the engine failed to load: a restart would fail the same way
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW]
            if len(self.restarts) >= self.config.engine_max_restarts:
                self.failure = f"engine crashed {len(self.restarts) + 1} times within {RESTART_WINDOW:.0f} s"
                log.error("%s; giving up, the worker exits so that gunicorn starts a fresh one", self.failure)
                self._on_give_up()
                return
            delay = RESTART_BACKOFF[min(len(self.restarts), len(RESTART_BACKOFF) - 1)]
            self.restarts.append(now)
            self.restart_count += 1
            self.metrics.engine_restarts.inc()
            log.warning(
                "restarting the engine in %.1f s (restart %d within %.0f s)", delay, len(self.restarts), RESTART_WINDOW
            )
            if self._stopping.wait(delay):
                return

    def ranks_alive(self) -> list[bool]:
        """Whether each of the engine's processes is alive: rank 0 (the engine process) and, with
        --tensor-parallel-size N, ranks 1..N-1 (which rank 0 started); [] before an engine has reported ready."""
        ready, process = self.ready, self.process
        if ready is None or process is None:
            return []
        return [process.is_alive()] + [_process_alive(pid) for pid in ready.rank_pids]

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    @property
    def open_places(self) -> int:
        """Row-and-queue places the open sessions take (a request with n choices takes n)."""
        return sum(s.places for s in list(self._sessions.values()))

    # requests
    def check_ready(self) -> EngineReady:
        """The engine's description, or a 503 while stopping, restarting, loading or after it failed."""
        if self._stopping.is_set():
            raise Unavailable("server is shutting down; retry shortly", retry_after=5)
        if self.failure is not None:
            raise Unavailable(f"backend unavailable: {self.failure}", retry_after=30)
        if self.ready is None:
            what = "the engine is restarting" if self.restarting else "model is loading"
            raise Unavailable(f"{what}, try again shortly", retry_after=5)
        return self.ready

    def team_places(self, team: str) -> int:
        """Row-and-queue places the team's open sessions take."""
        return sum(s.places for s in list(self._sessions.values()) if s.team == team)

    def submit(self, prompt_ids: list[int], params: SamplingParams, team: str | None = None) -> Session:
        """Open a session for the request (of ``team``, counted toward its places; None: not counted per team)."""
        session = self._open(Session(uuid.uuid4().hex, len(prompt_ids), n=params.n, team=team))
        self._send(GenerateRequest(session.id, tuple(prompt_ids), params, team))
        return session

    def embed(self, inputs: list[list[int]], normalize: bool = True, team: str | None = None) -> Session:
        """Open a session for inputs to embed or score (one event each; one place of the server's and the
        team's)."""
        session = Session(uuid.uuid4().hex, sum(len(i) for i in inputs), n=len(inputs), team=team, embeds=True)
        self._open(session)
        self._send(EmbedRequest(session.id, tuple(tuple(i) for i in inputs), normalize, team))
        return session

    def _open(self, session: Session) -> Session:
        """Count a new session in, within its team's places and the server's (Session.places: a request with n
        choices takes n); refused past either."""
        self.check_ready()
        with self._lock:
            cap = self.config.max_places_per_team
            team = session.team
            held = self.team_places(team) if team is not None and cap > 0 else 0
            if held and held + session.places > cap:  # (a team holding none may always start one request)
                raise RateLimited(
                    f"team {team!r} already holds {held} of this server's rows and queue places "
                    f"(at most {cap} per team; a request with n choices takes n); retry shortly",
                    retry_after=1,
                )
            places = self.open_places
            if places and places + session.places > self.config.max_open_sessions:
                raise Unavailable(
                    f"server busy: all {self.config.rows} rows and {self.config.max_waiting} queue places are taken",
                    retry_after=1,
                )
            self._sessions[session.id] = session
        self.metrics.submitted(session.prompt_tokens)
        return session

    def release(self, session: Session) -> None:
        """Forget a session; if it was still generating, tell the engine to free its row."""
        with self._lock:
            known = self._sessions.pop(session.id, None) is not None
        if not known:
            return
        self.metrics.ended(session.finish_reason or FinishReason.CANCELLED, session.started)
        if not session.done and self.ready is not None:
            self._send(CancelRequest(session.id))

    def abort_all(self, message: str) -> int:
        """End every open session with an error now (the drain deadline); the engine frees their rows."""
        sessions = self._fail_all(message)
        if self.ready is not None:
            for session in sessions:
                self._send(CancelRequest(session.id))
        return len(sessions)

    # LoRA adapters
    @property
    def adapters(self) -> tuple[AdapterInfo, ...]:
        """The LoRA adapters requests may name now: those loaded at start, with the loads and unloads since (a
        restarted engine gets the ones loaded at run time again)."""
        return self._adapters

    def load_adapter(self, name: str, path: str, timeout: float = ADAPTER_TIMEOUT) -> AdapterInfo:
        """Load a LoRA adapter (a GGUF from convert_lora_to_gguf.py or a PEFT folder) under a new name; ValueError
        with the engine's reason when it cannot (a bad file, a name in use, a model that takes none)."""
        reply = self._adapter_call(lambda rid: LoadAdapter(rid, name, str(path)), timeout)
        if reply.error is not None or reply.info is None:
            raise ValueError(reply.error or f"LoRA adapter {name!r} was not loaded")
        self._loaded_at_run_time[name] = reply.info
        return reply.info

    def unload_adapter(self, name: str, timeout: float = ADAPTER_TIMEOUT) -> bool:
        """Refuse a LoRA adapter to new requests (running ones finish with it; its memory is freed after the
        last); False: no adapter of that name is loaded."""
        reply = self._adapter_call(lambda rid: UnloadAdapter(rid, name), timeout)
        if reply.error is not None:
            raise ValueError(reply.error)
        self._loaded_at_run_time.pop(name, None)
        return reply.unloaded

    def _reload_adapters(self) -> tuple[AdapterInfo, ...]:
        """After a restart, the adapters loaded at run time, sent to the new engine before any request can be
        (its inbox is read in order; a file gone since is dropped when the engine's reply says so)."""
        for info in self._loaded_at_run_time.values():
            self._send(LoadAdapter(uuid.uuid4().hex, info.name, info.path))
        return tuple(self._loaded_at_run_time.values())

    def _adapter_call(self, message: Callable[[str], object], timeout: float) -> AdapterReply:
        """Send an adapter message and wait for its reply (Unavailable: no engine, or none answered in time)."""
        self.check_ready()
        rid = uuid.uuid4().hex
        answer: queue.SimpleQueue = queue.SimpleQueue()
        self._replies[rid] = answer
        try:
            self._send(message(rid))
            reply = answer.get(timeout=timeout)
        except queue.Empty:
            raise Unavailable(f"the engine did not answer the adapter request within {timeout:.0f} s") from None
        finally:
            self._replies.pop(rid, None)
        if reply is None:
            raise Unavailable("the engine stopped before it answered the adapter request", retry_after=5)
        return reply

    # output
    def _demux(self, process: SpawnProcess, outbox: Queue[Any]) -> bool:
        """Read the engine's output until it stops; True if it had been serving (so a restart makes sense)."""
        while not self._stopping.is_set():
            try:
                msg = outbox.get(timeout=0.2)
            except queue.Empty:
                if not process.is_alive():
                    return self._engine_lost(f"engine process exited (code {process.exitcode})")
                continue
            except (EOFError, OSError):
                return self._engine_lost("engine connection lost")
            if isinstance(msg, StepOutput):
                self.metrics.engine_stats(self.stats, msg.stats)
                self.stats = msg.stats
                for event in msg.events:
                    self._deliver(event)
            elif isinstance(msg, AdapterReply):
                self._adapters = msg.adapters
                waiting = self._replies.get(msg.request_id)
                if waiting is not None:
                    waiting.put(msg)
            elif isinstance(msg, EngineReady):
                self.tokenizer = self._load_tokenizer(msg)
                self._adapters = msg.adapters + self._reload_adapters()
                self.ready = msg
                self.restarting = False
                log.info("engine ready: %s on %s (pid %d)", msg.model_name, msg.device, process.pid)
            elif isinstance(msg, EngineFailed):
                self.failure = msg.message
                self._fail_all(msg.message)
                return False
        return False

    def _engine_lost(self, message: str) -> bool:
        served = self.ready is not None
        self.ready = None
        self.restarting = served
        if not served:
            self.failure = message
        self.stats = self._idle_stats()  # a new engine's cumulative counters start from zero
        self._fail_all(message)
        return served

    def _deliver(self, event: TokenEvent) -> None:
        session = self._sessions.get(event.session_id)
        if session is None:
            self.metrics.tokens(len(event.token_ids))
            return  # abandoned: the client has gone
        first = session.first_token_at is None
        at = self.metrics.tokens(len(event.token_ids), session.started if first else None, session.last_token_at)
        if event.token_ids:
            if first:
                session.first_token_at = at
            session.last_token_at = at
        session.choice_tokens[event.index] = max(session.choice_tokens.get(event.index, 0), event.completion_tokens)
        session.completion_tokens = sum(session.choice_tokens.values())
        if event.finished:
            session.finished_choices += 1
            if session.finished_choices >= session.n:  # (an error's consumer stops and cancels the others)
                session.finish_reason = event.finish_reason
        session.events.put(event)

    def _idle_stats(self) -> EngineStats:
        """The stats before an engine has reported any (at start and after it is lost)."""
        return EngineStats(rows_total=self.config.rows, kv_tokens_total=self.config.rows * self.config.context_length)

    def _load_tokenizer(self, ready: EngineReady) -> Tokenizer:
        if self.config.mock:
            from ..mock.tokenizer import ByteTokenizer

            return ByteTokenizer()
        from ..model.tokenizer import load_tokenizer
        from .lifeline import release_free_memory

        tokenizer = load_tokenizer(ready.model_dir)
        # (parsing tokenizer.json leaves freed pages the allocator keeps: 0.19 GB of Gemma 3's 262,144 tokens)
        release_free_memory()
        return tokenizer

    def _fail_all(self, message: str) -> list[Session]:
        for waiting in list(self._replies.values()):  # adapter calls awaiting an engine that is gone
            waiting.put(None)
        log.error("ending open requests: %s", message)
        with self._lock:
            sessions = [s for s in self._sessions.values() if not s.done]
        for session in sessions:
            session.finish_reason = FinishReason.ERROR
            session.events.put(TokenEvent(session.id, "", finish_reason=FinishReason.ERROR, error=message))
        return sessions


def _process_alive(pid: int) -> bool:
    """Whether a process that is not this one's child runs (a zombie waiting for its parent counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return False
    except (OSError, IndexError):
        pass
    try:  # no /proc: whether a signal could reach it
        os.kill(pid, 0)
        return True
    except OSError:
        return False
