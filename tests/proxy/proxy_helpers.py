"""Helpers for the proxy tests: free ports, subprocesses with bounded start-up, tokens."""

from __future__ import annotations

import signal
import sys
import time

import jwt
from servers import ROOT, Process, free_port, wait_idle  # noqa: F401 - one definition for all tests

SECRET = "proxy-tests-secret-" + "0123456789abcdef" * 4  # 83 bytes: long enough for HS512 too


def make_token(claims: dict | None = None, secret: str | bytes = SECRET, algorithm: str = "HS256", **extra) -> str:
    """A signed token; it expires in an hour unless the claims say otherwise (exp=None: a token without exp)."""
    payload = {"team_id": "team-a", "token_id": "token-1"} if claims is None else dict(claims)
    payload = {"exp": int(time.time()) + 3600, **payload, **extra}
    return jwt.encode({k: v for k, v in payload.items() if v is not None}, secret, algorithm=algorithm)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def start_proxy(
    upstream: str | list[str], *flags: str, secret: str | None = SECRET, env: dict[str, str] | None = None
) -> Process:
    """The proxy in front of one upstream URL, or of several (one --upstream flag each)."""
    port = free_port()
    upstreams = [upstream] if isinstance(upstream, str) else upstream
    argv = [
        sys.executable,
        "-m",
        "proxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *[arg for url in upstreams for arg in ("--upstream", url)],
        "--threads",
        "128",
        *flags,
    ]
    full_env = {**({"JWT_SECRET": secret} if secret is not None else {}), **(env or {})}
    # stop(): gunicorn's quick shutdown (SIGQUIT, about 0.4 s), not SIGTERM's drain, which ends on the gevent
    # worker's next one-second tick; the drain is tested where a test sends SIGTERM itself (test_proxy_lifecycle)
    return Process(argv, port, env=full_env, stop_signal=signal.SIGQUIT)


def start_mock_inference_server(tokens_per_second: float = 50, *flags: str, port: int | None = None) -> Process:
    """The real inference server over its mock backend (``python -m inference_api --mock``)."""
    port = port or free_port()
    argv = [sys.executable, "-m", "inference_api", "--mock", "--host", "127.0.0.1", "--port", str(port), *flags]
    return Process(
        argv, port, env={"MOCK_TOKENS_PER_SECOND": str(tokens_per_second)}, ready_timeout=180, ready_status=200
    )
