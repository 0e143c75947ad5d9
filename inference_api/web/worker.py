"""The server's gunicorn worker: gthread, with a deadline on each request's headers, so a client that sends
them slowly (or never) holds a thread for ``--header-timeout`` seconds at most; gunicorn's own errors in JSON."""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, cast

from gunicorn.workers.gthread import ThreadWorker

from lifecycle.deadlines import Watchdog
from lifecycle.raw_errors import JsonErrors

from ..engine.lifeline import scheduling_class

if TYPE_CHECKING:
    from flask import Flask


def _shut_read(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RD)  # the blocked header read sees EOF and the connection is closed


class ServerWorker(JsonErrors, ThreadWorker):
    def init_process(self):
        scheduling_class(web_worker=True)  # before any thread of the worker starts: they all inherit it
        self._deadlines = Watchdog()
        self._header_deadline = threading.local()
        super().init_process()

    def handle(self, conn):
        app = cast("Flask", self.wsgi)  # the server's app (inference_api.web.app.create_app)
        when = time.monotonic() + app.extensions["server_config"].header_timeout
        self._header_deadline.key = key = self._deadlines.call_at(when, lambda: _shut_read(conn.sock))
        try:
            return super().handle(conn)
        finally:
            self._deadlines.cancel(key)

    def handle_request(self, req, conn):
        self._deadlines.cancel(self._header_deadline.key)  # the headers are in
        return super().handle_request(req, conn)
