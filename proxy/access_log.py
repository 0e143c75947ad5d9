"""One JSON line per request, written when the response (stream included) has ended. Never the token."""
from __future__ import annotations

import json
import sys
import threading
from datetime import datetime, timezone
from typing import Any, TextIO


class AccessLog:
    def __init__(self, stream: TextIO | None = None):
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()

    def write(self, **fields: Any) -> None:
        record = {"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), **fields}
        line = json.dumps(record, separators=(",", ":"), default=str)
        with self._lock:
            try:
                self._stream.write(line + "\n")
                self._stream.flush()
            except (OSError, ValueError):
                pass  # a closed log stream must never break a response
