"""The app's side of the engine: starts the backend process, submits requests, demultiplexes its output.

One thread reads the engine's output queue and hands each event to its session's own queue, keyed by
session id, so no request ever sees another's tokens. Sessions are removed when they finish, fail or
are abandoned.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from .config import ServerConfig
from .engine.process import run_engine
from .errors import ApiError
from .messages import (CancelRequest, EngineFailed, EngineReady, EngineStats, FinishReason, GenerateRequest,
                       SamplingParams, Shutdown, StepOutput, TokenEvent)
from .metrics import Metrics
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Session:
    id: str
    prompt_tokens: int
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    finish_reason: FinishReason | None = None  # set by the demultiplexer when the last event arrives
    started: float = field(default_factory=time.monotonic)
    has_output: bool = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class EngineClient:
    def __init__(self, config: ServerConfig):
        self.config = config
        ctx = mp.get_context("spawn")  # a clean interpreter: no threads or locks inherited from the web worker
        self._inbox = ctx.Queue()
        self._outbox = ctx.Queue()
        self.process = ctx.Process(target=run_engine, args=(config, self._inbox, self._outbox),
                                   name="inference-engine", daemon=True)
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self.ready: EngineReady | None = None
        self.failure: str | None = None
        self.tokenizer: Tokenizer | None = None
        self.stats = EngineStats(rows_total=config.rows)
        self.metrics = Metrics(lambda: self.stats, lambda: self.open_sessions)

    # life cycle
    def start(self) -> "EngineClient":
        self.process.start()
        threading.Thread(target=self._demux, name="engine-demux", daemon=True).start()
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        if self.process.is_alive():
            self._inbox.put(Shutdown())
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(timeout)

    @property
    def state(self) -> str:
        if self.failure is not None:
            return "failed"
        return "ready" if self.ready is not None else "loading"

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    # requests
    def check_ready(self) -> EngineReady:
        """The engine's description, or a 503 while it loads or after it failed."""
        if self.failure is not None:
            raise ApiError(503, f"backend unavailable: {self.failure}", retry_after=30)
        if self.ready is None:
            raise ApiError(503, "model is loading, try again shortly", retry_after=5)
        return self.ready

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Session:
        self.check_ready()
        session = Session(uuid.uuid4().hex, len(prompt_ids))
        with self._lock:
            if len(self._sessions) >= self.config.max_open_sessions:
                raise ApiError(503, f"server busy: all {self.config.rows} rows and {self.config.max_waiting} "
                                    f"queue places are taken", retry_after=1)
            self._sessions[session.id] = session
        self.metrics.submitted(len(prompt_ids))
        self._inbox.put(GenerateRequest(session.id, tuple(prompt_ids), params))
        return session

    def release(self, session: Session) -> None:
        """Forget a session; if it was still generating, tell the engine to free its row."""
        with self._lock:
            known = self._sessions.pop(session.id, None) is not None
        if not known:
            return
        self.metrics.ended(session.finish_reason or FinishReason.CANCELLED, session.started)
        if not session.done and self.failure is None:
            self._inbox.put(CancelRequest(session.id))

    # output
    def _demux(self) -> None:
        while not self._stopping:
            try:
                msg = self._outbox.get(timeout=1.0)
            except queue.Empty:
                if not self.process.is_alive() and not self._stopping:
                    self._fail_all(f"engine process exited (code {self.process.exitcode})")
                    return
                continue
            except (EOFError, OSError):
                self._fail_all("engine connection lost")
                return
            if isinstance(msg, StepOutput):
                self.stats = msg.stats
                for event in msg.events:
                    self._deliver(event)
            elif isinstance(msg, EngineReady):
                self.tokenizer = self._load_tokenizer(msg)
                self.ready = msg
                log.warning("engine ready: %s on %s", msg.model_name, msg.device)
            elif isinstance(msg, EngineFailed):
                self._fail_all(msg.message)
                return

    def _deliver(self, event: TokenEvent) -> None:
        session = self._sessions.get(event.session_id)
        if session is None:
            self.metrics.tokens(len(event.token_ids))
            return  # abandoned: the client has gone
        self.metrics.tokens(len(event.token_ids), None if session.has_output else session.started)
        session.has_output = session.has_output or bool(event.token_ids)
        if event.finished:
            session.finish_reason = event.finish_reason
        session.events.put(event)

    def _load_tokenizer(self, ready: EngineReady) -> Tokenizer:
        if self.config.mock:
            from .mock.tokenizer import ByteTokenizer

            return ByteTokenizer()
        from .tokenizer import HFTokenizer

        return HFTokenizer(ready.model_dir)

    def _fail_all(self, message: str) -> None:
        log.error("backend failed: %s", message)
        self.failure = message
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.finish_reason = FinishReason.ERROR
            session.events.put(TokenEvent(session.id, "", finish_reason=FinishReason.ERROR, error=message))
