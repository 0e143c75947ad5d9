"""Per-request event streams: blocking reads of the session queue, client-disconnect detection, clean-up."""

from __future__ import annotations

import queue
import select
import socket
from collections.abc import Iterator

from ..engine.client import EngineClient, Session
from ..engine.messages import ErrorKind, FinishReason, TokenEvent
from ..request_errors import RateLimited, RequestError, Unavailable

SESSION_KEY = "inference_api.session"  # environ key: the request's engine session, read by the access log


def client_disconnected(environ: dict) -> bool:
    """True when the client has closed its connection (gunicorn exposes the socket; EOF shows as readable)."""
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def session_events(
    client: EngineClient, session: Session, environ: dict, poll_seconds: float = 0.5
) -> Iterator[TokenEvent]:
    """Yield the session's events until it finishes (each of its n choices, or an error); cancel it if the client
    leaves or the stream is closed."""
    environ[SESSION_KEY] = session
    finished = 0
    try:
        while True:
            try:
                event = session.events.get(timeout=poll_seconds)
            except queue.Empty:
                if client_disconnected(environ):
                    return
                continue
            if not event.finished and client_disconnected(environ):
                return
            yield event
            finished += event.finished
            if finished >= session.n or event.finish_reason is FinishReason.ERROR:
                return
    finally:
        client.release(session)


def first_event(events: Iterator[TokenEvent]) -> TokenEvent | None:
    """Wait for the first event before sending headers, so an early failure can still get a proper status: 400
    for a request the engine cannot serve as asked (a grammar it cannot build), 429 for a team over its share of
    a queue, 503 for a failure of the server's."""
    event = next(events, None)
    if event is not None and event.finish_reason is FinishReason.ERROR:
        message = event.error or "generation failed"
        if event.error_kind is ErrorKind.INVALID:
            raise RequestError(message)
        if event.error_kind is ErrorKind.BUSY:
            raise RateLimited(message, retry_after=1)
        raise Unavailable(message, retry_after=5)
    return event
