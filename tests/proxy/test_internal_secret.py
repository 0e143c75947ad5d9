"""No way around the proxy: with INTERNAL_SECRET the server answers only requests that carry it, which the proxy
adds (a client's own copy is dropped); GET /health stays open for probes."""

from __future__ import annotations

import sys

import pytest
import requests
from proxy_helpers import Process, bearer, free_port, make_token

INTERNAL = "internal-test-secret-" + "5" * 40


@pytest.fixture(scope="module")
def guarded_server():
    port = free_port()
    server = Process(
        [sys.executable, "-m", "inference_api", "--mock", "--host", "127.0.0.1", "--port", str(port)],
        port,
        env={"INTERNAL_SECRET": INTERNAL, "MOCK_TOKENS_PER_SECOND": "200"},
        ready_timeout=180,
        ready_status=200,
    )
    yield server
    server.stop()


def test_the_server_answers_only_requests_with_the_internal_secret(guarded_server):
    url = guarded_server.url
    assert requests.get(url + "/health", timeout=10).status_code == 200  # probes need no secret
    model = requests.get(url + "/health", timeout=10).json()["model"]
    direct = requests.post(f"{url}/inference/{model}", json={"text": "hi", "max_tokens": 2}, timeout=10)
    assert direct.status_code == 403 and "proxy" in direct.json()["message"]
    openai = requests.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=10)
    assert openai.status_code == 403 and openai.json()["error"]["type"] == "permission_error"
    wrong = requests.post(
        f"{url}/inference/{model}",
        json={"text": "hi", "max_tokens": 2},
        headers={"X-Internal-Secret": "guess"},
        timeout=10,
    )
    assert wrong.status_code == 403
    right = requests.post(
        f"{url}/inference/{model}",
        json={"text": "hi", "max_tokens": 2},
        headers={"X-Internal-Secret": INTERNAL},
        timeout=10,
    )
    assert right.status_code == 200


def test_the_proxy_adds_the_secret_and_drops_a_clients(guarded_server, make_proxy, stub):
    proxy = make_proxy(guarded_server.url, env={"INTERNAL_SECRET": INTERNAL})
    model = requests.get(guarded_server.url + "/health", timeout=10).json()["model"]
    through = requests.post(
        f"{proxy.url}/inference/{model}", json={"text": "hi", "max_tokens": 2}, headers=bearer(make_token()), timeout=30
    )
    assert through.status_code == 200, through.text
    echo = make_proxy(stub.url, env={"INTERNAL_SECRET": INTERNAL})
    seen = requests.get(
        echo.url + "/echo", headers={**bearer(make_token()), "X-Internal-Secret": "forged"}, timeout=10
    ).json()
    assert [v for n, v in seen["headers"] if n.lower() == "x-internal-secret"] == [INTERNAL]
