"""Start the real server (gunicorn, real processes) on a free loopback port, for end-to-end tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "SmolLM2-135M-Instruct"
# the converted default model is kept between runs (the same folder the serve command uses)
MODEL_CACHE = os.environ.get("MODEL_CACHE_DIR", str(ROOT / "model_cache"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m inference_api`` with the given flags; waits for /health to say ready."""

    def __init__(self, *flags: str, env: dict | None = None, ready_timeout: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="server-", suffix=".log", delete=False)
        # free memory varies with whatever else the machine runs: a pre-flight refusal must not fail unrelated
        # tests (tests/test_preflight.py and test_lifecycle.py test the refusal itself)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "SKIP_PREFLIGHT": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "inference_api", "--port", str(self.port), *flags],
                                     cwd=ROOT, env=full_env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.output()}")

    def health(self) -> dict:
        return requests.get(self.url + "/health", timeout=5).json()

    def wait_idle(self, timeout: float = 30) -> dict:
        """Wait until no session and no row is in use; return the last health body."""
        deadline = time.monotonic() + timeout
        while True:
            body = self.health()
            if (body["open_sessions"] == 0 and body["rows_in_use"] == 0) or time.monotonic() > deadline:
                return body
            time.sleep(0.1)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
