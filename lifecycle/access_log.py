"""One JSON line per request, written when the response (stream included) has ended. Never the token.

Shared by the proxy and the inference server, with the request id both put in it: the client's
``X-Request-Id`` when it is sane, else a fresh one.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import uuid
from datetime import UTC, datetime
from typing import Any, TextIO

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:+/=@-]{1,128}")


def request_id(given: str | None) -> str:
    """The incoming X-Request-Id if it is a plain token of at most 128 characters, else a new random id."""
    return given if given and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


class AccessLog:
    def __init__(self, stream: TextIO | None = None):
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()

    def write(self, **fields: Any) -> None:
        record = {"time": datetime.now(UTC).isoformat(timespec="milliseconds"), **fields}
        line = json.dumps(record, separators=(",", ":"), default=str)
        with self._lock:
            try:
                self._stream.write(line + "\n")
                self._stream.flush()
            except (OSError, ValueError):
                pass  # a closed log stream must never break a response
