"""The proxy under slow clients and deploys: 1,000 idle or trickling connections, read deadlines, 401 without
reading the body, and draining on SIGTERM in front of a draining inference server."""

from __future__ import annotations

import os
import resource
import select
import signal
import socket
import threading
import time

import requests
from proxy_helpers import bearer, make_token, start_mock_inference_server, start_proxy
from servers import stream_into, wait_for

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


def all_still_open(socks: list[socket.socket]) -> bool:
    """Nothing came from the other side of any of them, not even the end of the connection."""
    poller = select.poll()
    for sock in socks:
        poller.register(sock, select.POLLIN)
    return not poller.poll(0)


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
            # answered while every slow client still holds its connection: none of them has reached its 60 s
            # deadline, so a proxy that served them one at a time, or a thread each, would still be waiting
            r = requests.get(proxy.url + "/anything", headers=good, timeout=30)
            timings.append(time.monotonic() - started)
            assert r.status_code == 200
            for sock in trickling[:100]:
                sock.sendall(b"x")
        print(f"legitimate request with {SLOW_CONNECTIONS} slow connections open: {timings}")
        assert all_still_open(trickling + idle), "a slow client's connection ended first"
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
        assert read_until_closed(headers, 20) == b""  # closed, unanswered
        answer = read_until_closed(body, 20)  # the deadline it names is the one set
        assert answer.startswith(b"HTTP/1.1 408 ") and b"not received within 1 s" in answer
        assert requests.get(proxy.url + "/health", timeout=10).status_code == 200
    finally:
        headers.close()
        body.close()


def test_sigterm_to_server_and_proxy_lets_streams_through_the_proxy_finish():
    expected = "Echo: ab — " * 9  # 117 tokens: about 11.7 s at 10 tokens/s
    out: dict = {}
    with start_mock_inference_server(tokens_per_second=10) as server, start_proxy(server.url) as proxy:
        model = requests.get(server.url + "/health", timeout=10).json()["model"]
        token = bearer(make_token())
        url, body = f"{proxy.url}/inference/{model}", {"text": "ab", "max_tokens": len(expected.encode())}
        threads = [
            threading.Thread(target=stream_into, args=(out, f"s{i}", url, body), kwargs={"headers": token})
            for i in range(4)
        ]
        for t in threads:
            t.start()
        assert wait_for(lambda: requests.get(server.url + "/health", timeout=5).json()["rows_in_use"] == 4, 20)
        started = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)
        os.kill(proxy.proc.pid, signal.SIGTERM)
        # the masters pass the signal on to their workers
        assert wait_for(lambda: requests.get(proxy.url + "/health", timeout=5).status_code == 503, 10)
        assert requests.get(proxy.url + "/health", timeout=5).json()["status"] == "draining"
        refused = requests.post(
            f"{proxy.url}/v1/completions", headers=token, json={"model": model, "prompt": "x"}, timeout=5
        )
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["type"] == "server_error"
        for t in threads:
            t.join(120)
        # they ran past gunicorn's old fixed 10 s, which would have cut them. A lower bound, which load only raises:
        # the mock waits a whole step between tokens (it never catches up), and the streams, admitted just before
        # SIGTERM, had nearly all of their 11.7 s to go
        assert time.monotonic() - started > 10
        assert out == {f"s{i}": expected for i in range(4)}
        server.proc.wait(30)
        proxy.proc.wait(30)
