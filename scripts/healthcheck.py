#!/usr/bin/env python3
"""Container health check: exit 0 when every named port's ``GET http://127.0.0.1:<port>/health`` answers 200.

    python scripts/healthcheck.py PORT PROXY_PORT    # the all-in-one image: the server and the proxy before it
    python scripts/healthcheck.py PORT               # a server alone (compose, Kubernetes)
    python scripts/healthcheck.py PROXY_PORT         # the proxy image: it answers and a ready server is behind it

Each argument names the environment variable that holds the port (PORT defaults to 8000, PROXY_PORT to 1223),
so the check follows the same settings as the processes it checks. Standard library only (the proxy image has
no extra tools).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_PORTS = {"PORT": "8000", "PROXY_PORT": "1223"}


def check(port: str, timeout: float = 5.0) -> str | None:
    """None when healthy, else the reason."""
    url = f"http://127.0.0.1:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return None if response.status == 200 else f"{url}: {response.status}"
    except urllib.error.HTTPError as exc:
        return f"{url}: {exc.code} {exc.read(200).decode(errors='replace')}"
    except OSError as exc:
        return f"{url}: {exc}"


def main(argv: list[str]) -> int:
    names = argv or ["PORT"]
    unknown = [n for n in names if n not in DEFAULT_PORTS]
    if unknown:
        print(f"unknown port variable(s) {', '.join(unknown)}; use {' or '.join(DEFAULT_PORTS)}", file=sys.stderr)
        return 2
    problems = [p for p in (check(os.environ.get(n) or DEFAULT_PORTS[n]) for n in names) if p]
    for problem in problems:
        print(f"unhealthy: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
