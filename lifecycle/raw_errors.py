"""gunicorn's own error answers (a malformed request line, headers too large, a bad chunk size, a crash before the
app runs) in JSON instead of its HTML page, for the proxy's worker and the server's alike.

gunicorn writes them itself, before any app code runs, so no API dialect is known: the body is the shape the
proxy's and the native API's own errors have, ``{"status_code": N, "message": "..."}``.
"""

from __future__ import annotations

import html
import json
import re
from typing import TYPE_CHECKING, cast

_STATUS = re.compile(rb"^HTTP/1\.1 (\d{3}) ([^\r\n]*)\r\n")
_MESSAGE = re.compile(rb"</h1>\s*(.*?)\s*</body>", re.S)


class _Captured:
    """Stands for the client socket while gunicorn writes its HTML error, keeping the bytes instead."""

    def __init__(self) -> None:
        self.data = b""

    def gettimeout(self):
        return 0.0

    def setblocking(self, flag) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        self.data += bytes(data)

    def send(self, data: bytes) -> int:
        self.sendall(data)
        return len(data)


def json_error(html_answer: bytes) -> bytes:
    """gunicorn's HTML error answer rewritten as the same status with a JSON body."""
    status = _STATUS.match(html_answer)
    code, reason = (
        (int(status.group(1)), status.group(2).decode("latin1")) if status else (500, "Internal Server Error")
    )
    found = _MESSAGE.search(html_answer)
    message = html.unescape(found.group(1).decode("latin1")).strip() if found else ""
    body = json.dumps({"status_code": code, "message": message or reason}).encode()
    head = (
        f"HTTP/1.1 {code} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode("latin1")
    return head + body


if TYPE_CHECKING:
    import socket

    from gunicorn.workers.base import Worker as _Worker
else:
    _Worker = object


class JsonErrors(_Worker):
    """A gunicorn worker mixin: its own error answers in JSON (see the module's docstring)."""

    def handle_error(self, req, client, addr, exc):
        captured = _Captured()
        super().handle_error(req, cast("socket.socket", captured), addr, exc)  # the socket as far as it is used
        if captured.data:
            try:
                client.sendall(json_error(captured.data))
            except OSError:
                self.log.debug("Failed to send error message.")
