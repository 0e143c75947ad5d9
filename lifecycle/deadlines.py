"""Read deadlines for slow clients, and closing a connection whose request body is never going to be read.

A request body must arrive whole within its deadline: one watchdog thread (a greenlet under gevent) shuts the
socket's read side when a deadline passes, so the blocked read returns at once and the request is answered
408, whatever the server's worker class. A response carrying ``Connection: close`` (a 401 sent without reading
the body, a 408) makes gunicorn close the connection instead of reading the rest of the body first.
"""

from __future__ import annotations

import heapq
import io
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def read_capped(request, cache: bool = True) -> bytes:
    """A Flask request's whole body, read once (``cache``: kept for the route's own ``get_data``). One without a
    Content-Length (chunked) is read up to the app's MAX_CONTENT_LENGTH and refused with 413 beyond it, as a
    declared length over it is (werkzeug would cut it there silently); what was read then stands in for the
    stream, with its length, so werkzeug reads it as any body."""
    limit = request.max_content_length
    environ = request.environ
    if environ.get("CONTENT_LENGTH") or limit is None or "_cached_data" in request.__dict__:
        return request.get_data(cache=cache)
    from werkzeug.exceptions import RequestEntityTooLarge

    stream = environ["wsgi.input"]
    parts, total = [], 0
    while True:
        chunk = stream.read(min(1 << 16, limit + 1 - total))
        if not chunk:
            break
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise RequestEntityTooLarge()
    data = b"".join(parts)
    environ["wsgi.input"], environ["CONTENT_LENGTH"] = io.BytesIO(data), str(len(data))
    environ.pop("HTTP_TRANSFER_ENCODING", None)
    environ.pop("wsgi.input_terminated", None)
    return request.get_data(cache=cache)


class BodyTimeout(Exception):
    """The client did not send its request body within the deadline."""


# how late a deadline may fire: the thread sweeps every entry that has come due (most of them cancelled: the body
# or the headers arrived) at most this often, instead of waking once for each
SLACK = 0.05


class Watchdog:
    """Deadlines on one thread: it sleeps until the earliest, so only a new earlier deadline wakes it (each request
    sets two, both later than those before them: no wake-up of its own)."""

    def __init__(self):
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._pending: set[int] = set()
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def call_at(self, when: float, action: Callable[[], None]) -> int:
        with self._cond:
            if self._thread is None:  # started lazily: in the worker, after gevent has patched threading
                self._thread = threading.Thread(target=self._run, name="read-deadlines", daemon=True)
                self._thread.start()
            key = next(self._ids)
            self._pending.add(key)
            if not self._heap or when < self._heap[0][0]:
                self._cond.notify()
            heapq.heappush(self._heap, (when, key, action))
            return key

    def cancel(self, key: int) -> None:
        with self._cond:
            self._pending.discard(key)

    def _run(self) -> None:
        while True:
            due = []
            with self._cond:
                now = time.monotonic()
                while not self._heap or self._heap[0][0] > now:
                    self._cond.wait(None if not self._heap else max(self._heap[0][0] - now, SLACK))
                    now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, key, action = heapq.heappop(self._heap)
                    if key in self._pending:
                        self._pending.discard(key)
                        due.append(action)
            for action in due:
                try:
                    action()
                except OSError:
                    pass

    @contextmanager
    def deadline(self, environ: dict, seconds: float) -> Iterator[threading.Event]:
        """Within the block, reads from the request's socket end (EOF) once ``seconds`` have passed."""
        sock = environ.get("gunicorn.socket")
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            if sock is not None:
                sock.shutdown(socket.SHUT_RD)

        key = self.call_at(time.monotonic() + seconds, expire)
        try:
            yield expired
        finally:
            self.cancel(key)

    def read_body(self, environ: dict, read: Callable[[], bytes], seconds: float) -> bytes:
        """``read()`` the whole body, or raise BodyTimeout when it takes longer than ``seconds``."""
        with self.deadline(environ, seconds) as expired:
            try:
                body = read()
            except Exception:
                if expired.is_set():
                    raise BodyTimeout(f"request body not received within {seconds:g} s") from None
                raise
        if expired.is_set():
            raise BodyTimeout(f"request body not received within {seconds:g} s")
        return body


def close_when_asked(wsgi_app):
    """WSGI middleware: a response with ``Connection: close`` closes the connection (gunicorn otherwise drops that
    header and, to keep the connection alive, first reads whatever body the client is still sending)."""

    def app(environ, start_response):
        def start(status, headers, exc_info=None):
            if any(n.lower() == "connection" and v.lower() == "close" for n, v in headers):
                force_close = getattr(getattr(start_response, "__self__", None), "force_close", None)
                if force_close is not None:
                    force_close()
            return start_response(status, headers, exc_info)

        return wsgi_app(environ, start)

    return app
