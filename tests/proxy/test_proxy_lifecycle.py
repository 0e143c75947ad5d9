"""The proxy under slow clients and deploys: 1,000 idle or trickling connections, read deadlines, 401 without
reading the body, and draining on SIGTERM in front of a draining inference server."""

from __future__ import annotations

import os
import resource
import signal
import socket
import threading
import time

import requests
from proxy_helpers import bearer, make_token, start_mock_inference_server, start_proxy

SLOW_CONNECTIONS = 1000


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while True:
        piece = sock.recv(65536)
        if not piece:
            return data
        data += piece


def test_a_thousand_slow_clients_do_not_delay_a_legitimate_request(stub, make_proxy):
    raise_fd_limit(4 * SLOW_CONNECTIONS + 256)
    proxy = make_proxy(stub.url, "--header-timeout", "60", "--body-timeout", "60")
    port, good = proxy.port, bearer(make_token())
    bad_token, trickling, idle = [], [], []
    try:
        for i in range(SLOW_CONNECTIONS):
            sock = connect(port)
            kind = i % 3
            if kind == 0:  # headers with a bad token and a 100 kB body announced, then nothing
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                )
                bad_token.append(sock)
            elif kind == 1:  # a valid token and a body sent a byte at a time
                sock.sendall(
                    b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: "
                    + good["Authorization"].encode()
                    + b"\r\nContent-Length: 100000\r\n\r\n"
                )
                trickling.append(sock)
            else:  # headers only half sent
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                idle.append(sock)
        for sock in trickling:
            sock.sendall(b"x")
        timings = []
        for _ in range(3):
            started = time.monotonic()
            r = requests.get(proxy.url + "/anything", headers=good, timeout=30)
            timings.append(time.monotonic() - started)
            assert r.status_code == 200
            for sock in trickling[:100]:
                sock.sendall(b"x")
        print(f"legitimate request with {SLOW_CONNECTIONS} slow connections open: {timings}")
        assert min(timings) < 1.0, timings
        assert requests.get(proxy.url + "/health", timeout=30).status_code == 200
        # every bad-token client got its 401 at once, its body unread, and its connection closed
        for sock in bad_token[:50]:
            answer = read_until_closed(sock, 10)
            assert answer.startswith(b"HTTP/1.1 401 ") and b"connection: close" in answer.lower()
    finally:
        for sock in bad_token + trickling + idle:
            sock.close()


def test_header_and_body_deadlines(stub, make_proxy):
    proxy = make_proxy(stub.url, "--header-timeout", "1", "--body-timeout", "1")
    headers = connect(proxy.port)
    headers.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    body = connect(proxy.port)
    body.sendall(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + make_token().encode()
        + b"\r\nContent-Length: 100\r\n\r\n0123456789"
    )
    try:
        started = time.monotonic()
        assert read_until_closed(headers, 20) == b""  # closed, unanswered
        answer = read_until_closed(body, 20)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"not received within 1 s" in answer
        assert time.monotonic() - started < 15
        assert requests.get(proxy.url + "/health", timeout=10).status_code == 200
    finally:
        headers.close()
        body.close()


def test_sigterm_to_server_and_proxy_lets_streams_through_the_proxy_finish():
    server = start_mock_inference_server(tokens_per_second=10)
    proxy = start_proxy(server.url)
    model = requests.get(server.url + "/health", timeout=10).json()["model"]
    token = bearer(make_token())
    expected = "Echo: ab — " * 9  # 117 tokens: about 11.7 s at 10 tokens/s
    out: dict = {}

    def stream(key: str) -> None:
        try:
            with requests.post(
                f"{proxy.url}/inference/{model}",
                headers=token,
                stream=True,
                timeout=120,
                json={"text": "ab", "max_tokens": len(expected.encode())},
            ) as r:
                out[key] = b"".join(r.iter_content(chunk_size=None)).decode()
        except requests.RequestException as exc:
            out[key] = exc

    threads = [threading.Thread(target=stream, args=(f"s{i}",)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while requests.get(server.url + "/health", timeout=5).json()["rows_in_use"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)
        os.kill(proxy.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10  # the masters pass the signal on to their workers
        while (health := requests.get(proxy.url + "/health", timeout=5)).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert health.json()["status"] == "draining"
        refused = requests.post(
            f"{proxy.url}/v1/completions", headers=token, json={"model": model, "prompt": "x"}, timeout=5
        )
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["type"] == "server_error"
        for t in threads:
            t.join(120)
        assert time.monotonic() - started > 10
        assert out == {f"s{i}": expected for i in range(4)}
        server.proc.wait(30)
        proxy.proc.wait(30)
    finally:
        proxy.stop()
        server.stop()
