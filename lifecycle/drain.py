"""Graceful shutdown under gunicorn: on SIGTERM or SIGINT, refuse new work, let running streams finish, then exit.

The worker keeps its listening socket while it drains, so a new request gets an immediate 503 with Retry-After
(and ``/health`` says ``draining``) instead of a refused connection. When nothing is in flight any more, or at
the drain deadline (where what still runs is ended the way a failed stream ends), the worker stops; the master
waits for it (its graceful timeout follows the drain timeout), and every process exits.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable

from gunicorn.arbiter import Arbiter

log = logging.getLogger(__name__)

# seconds the gunicorn master waits beyond the drain timeout: cutting late streams and exiting
EXIT_MARGIN = 10
RETRY_AFTER = 5  # the Retry-After seconds sent while draining: by then another instance should take the traffic


class Drain:
    """Drain state of one worker. ``in_flight`` counts the streams still owed; ``cut`` ends them (deadline);
    ``finish`` runs once they are done (e.g. stop the engine)."""

    def __init__(
        self,
        timeout: float,
        in_flight: Callable[[], int],
        cut: Callable[[str], int],
        finish: Callable[[], None] = lambda: None,
    ):
        self.timeout = timeout
        self._in_flight = in_flight
        self._cut = cut
        self._finish = finish
        self._lock = threading.Lock()
        self.started: float | None = None

    @property
    def active(self) -> bool:
        return self.started is not None

    def begin(self, stop: Callable[[], None]) -> None:
        """Start draining (once); ``stop`` makes the worker leave its accept loop when the drain is over."""
        with self._lock:
            if self.started is not None:
                return
            self.started = started = time.monotonic()
        threading.Thread(target=self._run, args=(stop, started), name="drain", daemon=True).start()

    def _run(self, stop: Callable[[], None], started: float) -> None:
        deadline = started + self.timeout
        log.warning("draining: %d request(s) in flight, up to %.0f s to finish", self._in_flight(), self.timeout)
        while self._in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._in_flight():
            cut = self._cut(f"server shut down: the request did not finish within the {self.timeout:g} s drain")
            log.warning("drain deadline: ended %d unfinished request(s)", cut)
            end = time.monotonic() + 5.0  # let the cut streams send their error ending
            while self._in_flight() and time.monotonic() < end:
                time.sleep(0.05)
        else:
            log.warning("drained: no request in flight")
        try:
            self._finish()
        finally:
            stop()


def drain_on_signals(worker, drain: Drain) -> None:
    """gunicorn ``post_worker_init``: SIGTERM and SIGINT drain the worker instead of stopping it at once."""

    def stop() -> None:
        worker.cfg.set("graceful_timeout", 2)  # what is left are idle keep-alive or slow connections
        worker.handle_exit(signal.SIGTERM, None)

    def on_signal(signum, frame) -> None:
        gevent = sys.modules.get("gevent")
        if gevent is not None and gevent.monkey.is_module_patched("threading"):
            gevent.spawn(drain.begin, stop)  # a gevent signal callback must not block, even to start a thread
        else:
            drain.begin(stop)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


class DrainingArbiter(Arbiter):
    """gunicorn's master, with SIGINT (Ctrl-C) stopping as gracefully as SIGTERM rather than at once."""

    def handle_int(self):
        self.handle_term()


def gunicorn_settings(drain_timeout: float) -> dict:
    """The settings the server's and the proxy's gunicorn share: the master's graceful timeout follows the drain
    timeout; the control socket is off (its default path is one per user, which a second gunicorn would take
    over); and no peer may set SCRIPT_NAME, PATH_INFO or the scheme through headers (gunicorn trusts loopback
    by default: a SCRIPT_NAME header walked a path around the proxy's token check)."""
    return {
        "graceful_timeout": math.ceil(drain_timeout + EXIT_MARGIN),
        "control_socket_disable": True,
        "forwarded_allow_ips": "",
    }
