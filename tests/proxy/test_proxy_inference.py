"""Through the proxy to the real inference server on its mock backend (``python -m inference_api --mock``)."""

from __future__ import annotations

import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from proxy_helpers import bearer, make_token, wait_idle


@pytest.fixture(scope="module")
def model(inference_proxy) -> str:
    health = requests.get(inference_proxy.url + "/health", headers=bearer(make_token(admin=True)), timeout=10)
    assert health.status_code == 200
    return health.json()["model"]  # the details: an operator's token


def echo_of(prompt: str) -> str:
    """What the mock backend streams for a prompt: the prompt echoed, over and over."""
    return f"Echo: {prompt} — "


@pytest.mark.timeout(120)
def test_valid_token_streams_an_answer(inference_proxy, model):
    prompt = "héllo 日本 proxy"
    response = requests.post(
        f"{inference_proxy.url}/inference/{model}",
        json={"text": prompt, "max_tokens": 40},
        headers=bearer(make_token()),
        stream=True,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("text/plain")
    assert response.headers["X-Request-Id"]
    pieces = list(response.iter_content(chunk_size=None))
    assert len(pieces) > 1, "the answer came in one piece"
    body = b"".join(pieces)
    assert len(body) == 40  # the mock backend's tokens are bytes
    assert echo_of(prompt).encode().startswith(body) or body.startswith(echo_of(prompt).encode())
    assert body.decode("utf-8").startswith("Echo: héllo 日本")


@pytest.mark.timeout(60)
def test_without_token_the_server_is_never_reached(inference_proxy, model):
    response = requests.post(f"{inference_proxy.url}/inference/{model}", json={"text": "hi"}, timeout=10)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.timeout(120)
def test_client_disconnect_through_the_proxy_frees_the_row(inference_proxy, inference_server, model):
    sock = socket.create_connection(("127.0.0.1", inference_proxy.port), timeout=30)
    body = b'{"text": "long answer", "max_tokens": 1500}'
    sock.sendall(
        f"POST /inference/{model} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {make_token()}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    received = b""
    while len(received.partition(b"\r\n\r\n")[2]) < 6:  # at least one whole chunk ("1\r\nE\r\n") of the answer
        data = sock.recv(4096)
        assert data, received
        received += data
    assert received.startswith(b"HTTP/1.1 200")
    assert requests.get(inference_server.url + "/health", timeout=10).json()["rows_in_use"] >= 1
    sock.close()
    health = wait_idle(inference_server)
    assert health["open_sessions"] == 0 and health["rows_in_use"] == 0, health


@pytest.mark.timeout(300)
def test_64_concurrent_streams_lose_nothing_and_never_mix(inference_proxy, inference_server, model):
    count = 64
    prompts = [f"user {i:02d} {uuid.uuid4().hex[:8]}" for i in range(count)]
    barrier = threading.Barrier(count, timeout=60)

    def one(i: int) -> tuple[int, str]:
        token = make_token({"team_id": f"team-{i % 8}", "token_id": f"load-{i}"})
        expected = echo_of(prompts[i])
        barrier.wait()
        with requests.post(
            f"{inference_proxy.url}/inference/{model}",
            headers=bearer(token),
            timeout=240,
            json={"text": prompts[i], "max_tokens": len(expected.encode())},
        ) as response:
            return response.status_code, response.content.decode("utf-8")

    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(one, range(count)))
    for i, (status, text) in enumerate(results):
        assert status == 200, text
        assert text == echo_of(prompts[i]), f"stream {i} got {text!r}"
    health = wait_idle(inference_server)
    assert health["open_sessions"] == 0 and health["rows_in_use"] == 0, health
