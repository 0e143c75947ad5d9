"""Start real servers (gunicorn, real processes) on free loopback ports, for end-to-end tests."""

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


class Process:
    """A server subprocess on a free loopback port; ready once GET /health answers (any status unless told)."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        env: dict[str, str] | None = None,
        ready_timeout: float = 60,
        ready_status: int | None = None,
        stop_signal: int = signal.SIGTERM,
        cwd: Path = ROOT,
    ):
        self.port = port
        self.stop_signal = stop_signal
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="test-server-", suffix=".log", delete=False)  # noqa: SIM115
        full_env = {k: v for k, v in os.environ.items() if k != "JWT_SECRET"}
        full_env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=full_env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait_ready(ready_timeout, ready_status)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float, status: int | None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args} exited early ({self.proc.returncode}):\n{self.output()[-5000:]}")
            try:
                code = requests.get(self.url + "/health", timeout=2).status_code
                if status is None or code == status:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)  # a test starts a server some 150 times: every tenth of a second adds up
        raise RuntimeError(f"{self.proc.args} not ready after {timeout} s:\n{self.output()[-5000:]}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, self.stop_signal)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


class ServerProcess(Process):
    """``python -m inference_api`` with the given flags on a free loopback port; waits for /health to say ready."""

    def __init__(self, *flags: str, env: dict | None = None, ready_timeout: float = 300):
        port = free_port()
        # free memory varies with whatever else the machine runs: a pre-flight refusal must not fail unrelated
        # tests (tests/test_preflight.py and test_lifecycle.py test the refusal itself)
        super().__init__(
            [sys.executable, "-m", "inference_api", "--port", str(port), *flags],
            port,
            env={"SKIP_PREFLIGHT": "1", **(env or {})},
            ready_timeout=ready_timeout,
            ready_status=200,
        )

    def health(self) -> dict:
        return requests.get(self.url + "/health", timeout=5).json()

    def wait_idle(self, timeout: float = 30) -> dict:
        return wait_idle(self, timeout)


def wait_idle(server: Process, timeout: float = 30) -> dict:
    """Wait until the inference server holds no session and no row; return its last /health body."""
    deadline = time.monotonic() + timeout
    while True:
        body = requests.get(server.url + "/health", timeout=10).json()
        if (body["open_sessions"] == 0 and body["rows_in_use"] == 0) or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def wait_for(predicate, timeout: float) -> bool:
    """Poll until predicate() is true or the time is up; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


class RedisProcess:
    """A real redis-server (Debian's package) on a free loopback port, nothing saved to disk."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        self.client = client

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
