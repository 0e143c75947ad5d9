"""The offline API's results: a request's ``ResultQueue`` (its output as it comes, its status), the
``RequestHandle`` that ``LLM.start_request`` returns, and the whole results ``generate`` and ``chat`` return."""

from __future__ import annotations

import collections
import enum
import threading
import time
from dataclasses import dataclass
from queue import Empty
from typing import TYPE_CHECKING, Any

from ..engine.client import Session
from ..engine.messages import FinishReason, TokenEvent, TokenLogprob
from ..request.tools import ToolCall, Tools

if TYPE_CHECKING:
    from .llm import LLM, SamplingParams


class RequestStatus(str, enum.Enum):
    WAITING = "waiting"  # queued for a free row
    PREFILLING = "prefilling"  # in a row, its prompt going into the KV cache
    GENERATING = "generating"  # output tokens arriving
    INTERRUPTED = "interrupted"  # stopped by stop_request, release_request or close, or failed by the engine
    FINISHED = "finished"  # ended by the end token, a stop string or max_tokens


@dataclass(frozen=True)
class Output:
    """What one ``get`` returns: every token and its text produced since the previous ``get`` (with n choices:
    one choice's, ``index``)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None  # None unless SamplingParams(logprobs=...) asked for them
    finish_reason: str | None  # set on the last output of a request
    completion_tokens: int  # tokens generated so far
    error: str | None = None
    index: int = 0  # the choice (of SamplingParams n) this output belongs to: each get returns one choice's


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's whole result from ``generate`` or ``chat``."""

    index: int  # position in the input
    prompt: Any  # as given: text, token ids or a conversation
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # stop, length, eos; cancelled or error only with errors="return"
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None
    error: str | None = None
    # every choice of a request with SamplingParams(n=...) (choice 0's are the fields above); one for n=1
    outputs: tuple[ChoiceOutput, ...] = ()
    # a chat with tools: the calls parsed out of text (which keeps the model's whole text), as the chat API's
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ChoiceOutput:
    """One of a request's n choices."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()


class ResultQueue:
    """One request's output queue and status. ``get`` never blocks on a request that has ended: it returns None."""

    def __init__(self, llm: LLM, session: Session, want_logprobs: bool):
        self._llm = llm
        self._session = session
        self._want_logprobs = want_logprobs
        self._read = threading.Lock()  # its holder alone takes events off the session queue (keeps their order)
        self._state = threading.Lock()
        self._buffer: collections.deque[TokenEvent] = collections.deque()
        self._end: RequestStatus | None = None
        self._generating = False
        self._released = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.prompt_tokens = session.prompt_tokens
        self.generated_length = 0  # tokens generated so far (received from the engine), every choice's
        self._finished: dict[int, str] = {}  # choices ended: index -> finish reason

    # reading
    def get(self, timeout: float | None = None) -> Output | None:
        """New output, waiting up to ``timeout`` seconds (None: until some arrives); None on timeout or when the
        request has ended and everything has been read."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._read.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return self._pop()
        try:
            while True:
                self._drain()
                if self._buffer or self._end is not None:
                    return self._pop()
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    return None
                try:
                    self._take(self._session.events.get(timeout=wait))
                except Empty:
                    return None
        finally:
            self._read.release()

    def get_nowait(self) -> Output | None:
        """New output if any has arrived, else None at once."""
        self._poll()
        return self._pop()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request ends (its output stays queued); False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._read.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        try:
            self._drain()
            while self._end is None:
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    return False
                try:
                    self._take(self._session.events.get(timeout=wait))
                except Empty:
                    return False
            return True
        finally:
            self._read.release()

    # status
    @property
    def status(self) -> RequestStatus:
        self._poll()
        if self._end is not None:
            return self._end
        if self._generating:
            return RequestStatus.GENERATING
        return self._llm._queued_status(self)

    @property
    def ended(self) -> bool:
        self._poll()
        return self._end is not None

    # internals
    def _poll(self) -> None:
        """Take what has arrived, unless another thread is reading (it takes it as it arrives)."""
        if self._read.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._read.release()

    def _drain(self) -> None:
        while self._end is None:
            try:
                event = self._session.events.get_nowait()
            except Empty:
                return
            self._take(event)

    def _take(self, event: TokenEvent) -> None:
        with self._state:
            if self._end is not None:
                return  # output after a stop: nobody asked for it
            if not self._released:
                self._buffer.append(event)
            self.generated_length += len(event.token_ids)
            self._generating = self._generating or bool(event.token_ids)
            reason = event.finish_reason
            if reason is None:  # not finished
                return
            ok = reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.EOS)
            self._finished[event.index] = reason.value
            if ok and len(self._finished) < self._session.n:
                return  # other choices still running
            self.finish_reason = (self._finished.get(0) if ok else None) or reason.value
            self.error = event.error
            self._end = RequestStatus.FINISHED if ok else RequestStatus.INTERRUPTED
        self._llm._ended(self)

    def _pop(self) -> Output | None:
        """The buffered output of one choice (the oldest's; all of it for n=1); the other choices' stays queued."""
        with self._state:
            if not self._buffer:
                return None
            index = self._buffer[0].index
            events = [e for e in self._buffer if e.index == index or e.finish_reason is FinishReason.CANCELLED]
            rest = [e for e in self._buffer if not (e.index == index or e.finish_reason is FinishReason.CANCELLED)]
            self._buffer.clear()
            self._buffer.extend(rest)
        last = events[-1]
        return Output(
            token_ids=tuple(t for e in events for t in e.token_ids),
            text="".join(e.text for e in events),
            logprobs=tuple(lp for e in events for lp in e.logprobs) if self._want_logprobs else None,
            finish_reason=last.finish_reason.value if last.finish_reason is not None else None,
            completion_tokens=self.generated_length if self._session.n == 1 else last.completion_tokens,
            error=last.error,
            index=index,
        )

    def _interrupt(self, message: str | None) -> None:
        """End the request here: the events before this marker are kept, anything after it is dropped."""
        self._session.events.put(TokenEvent(self._session.id, "", finish_reason=FinishReason.CANCELLED, error=message))
        self._poll()

    def _release(self) -> None:
        with self._state:
            self._released = True
            self._buffer.clear()


class RequestHandle:
    """What ``start_request`` returns: the request's id, prompt tokens and result queue."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        params: SamplingParams,
        queue: ResultQueue,
        tools: Tools | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.queue = queue
        self.tools = tools  # a conversation's tools: its results' calls are parsed

    @property
    def status(self) -> RequestStatus:
        return self.queue.status

    @property
    def finish_reason(self) -> str | None:
        return self.queue.finish_reason

    def __repr__(self) -> str:
        return f"<RequestHandle {self.request_id[:8]} {self.status.value}>"
