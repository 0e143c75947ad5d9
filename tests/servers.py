"""Start real servers (gunicorn, real processes) on free loopback ports, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self, TypeVar

import requests

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "SmolLM2-135M-Instruct"
# the converted default model is kept between runs (the same folder the serve command uses)
MODEL_CACHE = os.environ.get("MODEL_CACHE_DIR", str(ROOT / "model_cache"))


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something truthy or ``timeout`` seconds have
    passed: its last value, truthy on success (``assert wait_for(...)``). The one polling helper of the tests; the
    timeout only bounds the wait, it is never what a test asserts."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def native(server, model_name: str, body: dict, chat: bool = False, timeout: float = 30, **kwargs) -> requests.Response:
    """POST ``body`` to the native route of ``model_name``: /inference/..., or /predictions/... (through the chat
    template) when ``chat``; ``kwargs`` go to requests (stream=True, headers, ...)."""
    route = "predictions" if chat else "inference"
    return requests.post(f"{server.url}/{route}/{model_name}", json=body, timeout=timeout, **kwargs)


def read_text(response: requests.Response) -> str:
    """A streamed answer's body, read to its end."""
    return b"".join(response.iter_content(chunk_size=None)).decode()


def stream_into(out: dict, key: str, url: str, body: dict, read=read_text, **kwargs) -> None:
    """One streamed POST to its end (a thread's target): ``out[key]`` is what ``read`` makes of the answer, or the
    exception that cut it; ``kwargs`` go to requests (headers, ...)."""
    try:
        with requests.post(url, json=body, stream=True, timeout=120, **kwargs) as r:
            out[key] = read(r)
    except requests.RequestException as exc:
        out[key] = exc


def alive(pid: int) -> bool:
    """The process runs (a zombie waiting to be reaped counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stopped:
    """Stopped when its ``with`` block ends (a fixture: ``with ... as server: yield server``)."""

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


class Process(Stopped):
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
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args} exited early ({self.proc.returncode}):\n{self.output()[-5000:]}")
            try:
                code = requests.get(self.url + "/health", timeout=2).status_code
            except requests.RequestException:
                return False
            return status is None or code == status

        # every 0.05 s: a test starts a server some 150 times, and every tenth of a second adds up
        if not wait_for(ready, timeout):
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


def model_server(*flags: str):
    """A server fixture's body: the embedded model with the tests' context and queue, and these flags; stopped when
    the fixture ends (``yield from model_server(...)``)."""
    with ServerProcess(
        "--model-cache-dir", MODEL_CACHE, "--context-length", "1024", "--max-waiting", "64", *flags
    ) as server:
        yield server


def wait_idle(server: Process, timeout: float = 30) -> dict:
    """Wait until the inference server holds no session and no row; return its last /health body."""
    bodies: list[dict] = []

    def idle() -> bool:
        bodies.append(requests.get(server.url + "/health", timeout=10).json())
        return bodies[-1]["open_sessions"] == 0 and bodies[-1]["rows_in_use"] == 0

    wait_for(idle, timeout, 0.1)
    return bodies[-1]


class RedisProcess(Stopped):
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

        def ready() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return self.proc.poll() is not None  # ended: no use waiting

        if not wait_for(ready, 20) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("redis-server did not start")
        self.client = client

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


PROXY_SECRET = "test-secret-" + "x" * 40  # at least 32 bytes, or the proxy warns


def jwt_proxy(upstream: str, secret: str = PROXY_SECRET) -> Process:
    """The JWT proxy (``python -m proxy``) in front of one server, on a free loopback port."""
    port = free_port()
    argv = [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port), "--upstream", upstream]
    return Process(argv, port, env={"JWT_SECRET": secret}, ready_status=200)


def team_token(secret: str = PROXY_SECRET, **claims) -> str:
    """A token the proxy takes: team-a's key-1 for an hour unless the claims say otherwise."""
    import jwt

    payload = {"team_id": "team-a", "token_id": "key-1", "exp": int(time.time()) + 3600, **claims}
    return jwt.encode(payload, secret, algorithm="HS256")
