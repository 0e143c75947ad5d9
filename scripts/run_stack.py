#!/usr/bin/env python3
"""Run the whole stack: the inference server on loopback and the JWT proxy in front of it.

On a first run it writes a random JWT_SECRET into a git-ignored .env (unless JWT_SECRET is set), then
prints a ready-to-paste curl command with a valid token and the address of the chat page. Ctrl-C drains
and stops both (a second Ctrl-C stops them at once). Flags after the script name go to the inference
server (for example --mock, or --model PATH).

With --require-secret (the container images' command) JWT_SECRET must come from the environment: without it
the stack refuses to start, nothing is written and no token is printed. The ports and the proxy's address
also come from the environment there (PORT, PROXY_PORT, PROXY_HOST), as the server and the proxy read them.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import jwt
import requests

ROOT = Path(__file__).resolve().parent.parent
DRAIN_WAIT = 110  # seconds: the proxy's default drain (90 s) and its exit margin


def load_env_file(path: Path) -> dict[str, str]:
    values = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and not key.startswith("#"):
                values[key.strip()] = value.strip().strip('"')
    return values


def ensure_secret(env: dict[str, str], env_file: Path) -> str:
    if env.get("JWT_SECRET"):
        return env["JWT_SECRET"]
    secret = secrets.token_urlsafe(48)
    # readable by its owner only (0600), a file that existed before included
    with os.fdopen(os.open(env_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(f"JWT_SECRET={secret}\n")
    print(f"created a random JWT_SECRET in {env_file}")
    return secret


def wait_ready(url: str, procs: list[subprocess.Popen], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process exited during start-up")
        try:
            r = requests.get(url + "/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s")


MISSING_SECRET = (
    "JWT_SECRET is not set: refusing to start an open model server. Pass a secret of at least 32 "
    'random bytes, e.g. docker run -e JWT_SECRET="$(openssl rand -base64 48)" -p 1223:1223 IMAGE'
)


def main() -> int:
    env_in = os.environ
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--server-port",
        type=int,
        default=int(env_in.get("PORT") or 8000),
        help="the server's port on 127.0.0.1 (env PORT)",
    )
    ap.add_argument(
        "--proxy-port",
        type=int,
        default=int(env_in.get("PROXY_PORT") or 1223),
        help="the proxy's port (env PROXY_PORT)",
    )
    ap.add_argument(
        "--proxy-host",
        default=env_in.get("PROXY_HOST") or "0.0.0.0",
        help="the proxy's listen address, the stack's public side (env PROXY_HOST)",
    )
    ap.add_argument("--env-file", type=Path, default=ROOT / ".env", help="where JWT_SECRET is kept")
    ap.add_argument(
        "--require-secret",
        action="store_true",
        help="JWT_SECRET must be in the environment: never generated, never printed in a token",
    )
    ap.add_argument("--ready-timeout", type=float, default=600)
    args, server_flags = ap.parse_known_args()

    if args.require_secret:
        if not env_in.get("JWT_SECRET"):
            print(f"error: {MISSING_SECRET}", file=sys.stderr)
            return 2
        env = dict(env_in)
    else:
        env = {**load_env_file(args.env_file), **env_in}
        env["JWT_SECRET"] = ensure_secret(env, args.env_file)
    env.setdefault("PYTHONUNBUFFERED", "1")
    server_url = f"http://127.0.0.1:{args.server_port}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inference_api",
                "--host",
                "127.0.0.1",
                "--port",
                str(args.server_port),
                *server_flags,
            ],
            cwd=ROOT,
            env=env,
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "--host",
                args.proxy_host,
                "--port",
                str(args.proxy_port),
                "--upstream",
                server_url,
            ],
            cwd=ROOT,
            env=env,
        ),
    ]

    def stop(*_):
        """Drain both (running streams finish, up to the proxy's 90 s drain); a second Ctrl-C stops at once."""
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        try:
            for p in procs:
                p.wait(DRAIN_WAIT)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            for p in procs:
                if p.poll() is None:
                    p.kill()

    signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(0)))
    # Ctrl-C drains and stops the stack even when started where SIGINT is ignored (a background job of a
    # script: `cmd &` in a non-interactive shell starts it with SIGINT ignored, and Python then keeps it so)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        health = wait_ready(server_url, procs, args.ready_timeout)
        wait_ready(f"http://127.0.0.1:{args.proxy_port}", procs, 60)
        if args.require_secret:
            print(
                f"\nReady: {health['model']} behind the JWT proxy on port {args.proxy_port} (the server listens "
                f"on 127.0.0.1:{args.server_port} only). Make a token with scripts/jwt_util.py and your "
                f"JWT_SECRET; the chat page is at / on the same port.\n",
                flush=True,
            )
            return _wait(procs)
        token = jwt.encode(
            {"team_id": "local", "token_id": "readme", "exp": int(time.time()) + 30 * 86400},
            env["JWT_SECRET"],
            algorithm="HS256",
        )
        print(
            f"\nReady: {health['model']} behind the JWT proxy on port {args.proxy_port}. Try:\n\n"
            f"curl -N http://127.0.0.1:{args.proxy_port}/predictions/{quote(health['model'], safe='/')} \\\n"
            f"  -H 'Authorization: Bearer {token}' \\\n"
            f"  -H 'Content-Type: application/json' \\\n"
            f'  -d \'{{"text": "What is the capital of France?", "max_tokens": 64}}\'\n\n'
            f"Or chat in a browser: http://127.0.0.1:{args.proxy_port}/ (paste the token after 'Bearer' "
            f"when the page asks).\n\n"
            f"Ctrl-C drains and stops both processes.\n",
            flush=True,
        )
        return _wait(procs)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        stop()


def _wait(procs: list[subprocess.Popen]) -> int:
    """Until one process exits (the other is then stopped): the stack lives and dies as one."""
    while all(p.poll() is None for p in procs):
        time.sleep(0.5)
    print("a process exited; stopping the stack", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
