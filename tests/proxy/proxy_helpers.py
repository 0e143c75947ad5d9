"""Helpers for the proxy tests: free ports, subprocesses with bounded start-up, tokens."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jwt
import requests

from servers import ROOT, free_port  # noqa: F401 - one free_port for all tests

SECRET = "proxy-tests-secret-" + "0123456789abcdef" * 4  # 83 bytes: long enough for HS512 too


def make_token(claims: dict | None = None, secret: str | bytes = SECRET, algorithm: str = "HS256", **extra) -> str:
    payload = {"team_id": "team-a", "token_id": "token-1"} if claims is None else dict(claims)
    payload.update(extra)
    return jwt.encode(payload, secret, algorithm=algorithm)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Process:
    """A server subprocess on a free loopback port; ready once GET /health answers (any status unless told)."""

    def __init__(self, argv: list[str], port: int, env: dict[str, str] | None = None, ready_timeout: float = 60,
                 ready_status: int | None = None, stop_signal: int = signal.SIGTERM):
        self.port = port
        self.stop_signal = stop_signal
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="proxy-test-", suffix=".log", delete=False)
        full_env = {k: v for k, v in os.environ.items() if k != "JWT_SECRET"}
        full_env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_ready(ready_timeout, ready_status)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float, status: int | None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args} exited early ({self.proc.returncode}):\n{self.output()}")
            try:
                code = requests.get(self.url + "/health", timeout=2).status_code
                if status is None or code == status:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.proc.args} not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, self.stop_signal)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def wait_idle(server: Process, timeout: float = 20) -> dict:
    """Wait until the inference server holds no session and no row; return its last /health body."""
    deadline = time.monotonic() + timeout
    while True:
        health = requests.get(server.url + "/health", timeout=10).json()
        if (health["open_sessions"] == 0 and health["rows_in_use"] == 0) or time.monotonic() > deadline:
            return health
        time.sleep(0.1)


def start_proxy(upstream: str | list[str], *flags: str, secret: str | None = SECRET,
                env: dict[str, str] | None = None) -> Process:
    """The proxy in front of one upstream URL, or of several (one --upstream flag each)."""
    port = free_port()
    upstreams = [upstream] if isinstance(upstream, str) else upstream
    argv = [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port),
            *[arg for url in upstreams for arg in ("--upstream", url)], "--threads", "128", *flags]
    full_env = {**({"JWT_SECRET": secret} if secret is not None else {}), **(env or {})}
    return Process(argv, port, env=full_env)


def start_mock_inference_server(tokens_per_second: float = 50, *flags: str, port: int | None = None) -> Process:
    """The real inference server over its mock backend (``python -m inference_api --mock``)."""
    port = port or free_port()
    argv = [sys.executable, "-m", "inference_api", "--mock", "--host", "127.0.0.1", "--port", str(port), *flags]
    return Process(argv, port, env={"MOCK_TOKENS_PER_SECOND": str(tokens_per_second)}, ready_timeout=180,
                   ready_status=200)
