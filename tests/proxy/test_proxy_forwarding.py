"""What the upstream sees and what the client gets back: methods, targets, bodies, headers, statuses, the log."""

from __future__ import annotations

import base64
import json

import pytest
import requests
from proxy_helpers import bearer, make_token
from servers import wait_for


def echo(proxy, method="GET", target="/echo", headers=None, **kwargs):
    response = requests.request(
        method, proxy.url + target, headers={**bearer(make_token()), **(headers or {})}, timeout=10, **kwargs
    )
    assert response.status_code == 200, response.text
    seen = response.json()
    seen["headers_dict"] = {}
    for name, value in seen["headers"]:
        seen["headers_dict"].setdefault(name.lower(), []).append(value)
    return response, seen


def test_headers_rewritten(proxy, stub):
    client_headers = {
        "X-Team-Id": "evil-team",
        "x-token-id": "evil-token",
        "X-Forwarded-For": "10.1.2.3",
        "Forwarded": "for=10.9.9.9",
        "X-Real-IP": "10.8.8.8",
        "X-Original-URL": "/admin",
        "SCRIPT_NAME": "/v1",
        "X-Request-Id": "client-request-42",
        "Connection": "keep-alive, X-Client-Hop",
        "X-Client-Hop": "1",
        "Keep-Alive": "timeout=30",
        "Proxy-Authorization": "Basic eDp5",
        "TE": "trailers",
        "Trailer": "X-Sum",
        "Upgrade": "example/1",
        "Proxy-Connection": "keep-alive",
        "X-Custom": "kept",
        "User-Agent": "proxy-test/1",
    }
    response, seen = echo(proxy, headers=client_headers)
    h = seen["headers_dict"]
    assert h["host"] == [f"127.0.0.1:{stub.port}"]
    assert "authorization" not in h
    assert h["x-team-id"] == ["team-a"] and h["x-token-id"] == ["token-1"]
    # a client's word on its address, path or request id is not passed on as fact: the proxy's own instead
    assert h["x-forwarded-for"] == ["127.0.0.1"]
    assert h["x-forwarded-proto"] == ["http"]
    assert h["x-forwarded-host"] == [f"127.0.0.1:{proxy.port}"]
    assert h["x-request-id"] != ["client-request-42"] and len(h["x-request-id"][0]) >= 16
    for claim in ("forwarded", "x-real-ip", "x-original-url", "script_name"):
        assert claim not in h, claim
    assert h["x-custom"] == ["kept"] and h["user-agent"] == ["proxy-test/1"]
    for hop in (
        "x-client-hop",
        "keep-alive",
        "proxy-authorization",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
        "transfer-encoding",
    ):
        assert hop not in h, hop
    assert h.get("connection", ["keep-alive"]) == ["keep-alive"]  # only the proxy's own connection handling
    # response: upstream headers pass, hop-by-hop ones do not; the request id comes back
    assert response.headers["X-Stub"] == "yes"
    assert "X-Stub-Hop" not in response.headers
    assert "Keep-Alive" not in response.headers
    assert response.headers["X-Request-Id"] == h["x-request-id"][0]
    assert response.headers["Set-Cookie"] == "session=user-a; Path=/"


def test_upstream_cookies_are_not_kept_by_the_proxy(proxy):
    """The proxy's upstream session is shared by every user: one user's Set-Cookie must not reach another."""
    first, _ = echo(proxy)
    assert "Set-Cookie" in first.headers
    _, seen = echo(proxy, headers=bearer(make_token({"team_id": "other", "token_id": "o"})))
    assert "cookie" not in seen["headers_dict"]
    _, seen = echo(proxy, headers={"Cookie": "mine=1"})
    assert seen["headers_dict"]["cookie"] == ["mine=1"]


def test_request_id_created_when_absent_or_unusable(proxy):
    response, seen = echo(proxy)
    created = response.headers["X-Request-Id"]
    assert len(created) >= 16 and seen["headers_dict"]["x-request-id"] == [created]
    response, seen = echo(proxy, headers={"X-Request-Id": "bad id with spaces"})
    assert response.headers["X-Request-Id"] != "bad id with spaces"
    assert seen["headers_dict"]["x-request-id"] == [response.headers["X-Request-Id"]]


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
def test_methods_targets_and_bodies_pass_unchanged(proxy, method):
    body = bytes(range(256)) * 3 if method not in ("GET", "OPTIONS") else b""
    root = [] if method == "GET" else ["/"]  # GET / is the proxy's own chat page
    for target in [
        "/v1/chat/completions?stream=true&x=%20y",
        "/generate",
        "/predictions/m",
        "/inference/m",
        *root,
        "/a%2Fb//c/",
        "/any/thing?q=%E6%97%A5",
    ]:
        response, seen = echo(proxy, method, target, data=body)
        assert seen["method"] == method
        assert seen["target"] == target
        assert base64.b64decode(seen["body"]) == body


def test_chunked_request_body_is_forwarded(proxy):
    _, seen = echo(proxy, "POST", "/inference/m", data=iter([b'{"text": ', b'"chunked"}']))
    assert base64.b64decode(seen["body"]) == b'{"text": "chunked"}'
    assert seen["headers_dict"]["content-length"] == ["19"]


def test_head_passes_headers_without_body(proxy):
    response = requests.head(proxy.url + "/anything", headers=bearer(make_token()), timeout=10)
    assert response.status_code == 200
    assert response.headers["X-Stub"] == "head" and response.headers["Content-Length"] == "42"
    assert response.content == b""


@pytest.mark.parametrize("status", [400, 404, 429, 500, 503])
def test_upstream_status_and_body_pass_through(proxy, status):
    response = requests.post(proxy.url + f"/status/{status}", headers=bearer(make_token()), timeout=10)
    assert response.status_code == status
    assert response.json() == {"status": status}
    assert response.headers["Retry-After"] == "7"


def test_proxy_errors_are_json(proxy, stub, make_proxy):
    response = requests.request("TRACE", proxy.url + "/echo", headers=bearer(make_token()), timeout=10)
    assert response.status_code == 405 and response.json()["status_code"] == 405
    small = make_proxy(stub.url, "--max-body-bytes", "1000")
    response = requests.post(small.url + "/echo", data=b"x" * 5000, headers=bearer(make_token()), timeout=10)
    assert response.status_code == 413
    assert response.json() == {"status_code": 413, "message": "request body too large"}
    # the same bytes chunked (no Content-Length): refused too, never cut and forwarded
    chunked = requests.post(small.url + "/echo", data=iter([b"x" * 1000] * 5), headers=bearer(make_token()), timeout=10)
    assert chunked.status_code == 413 and chunked.json()["message"] == "request body too large"


def _log_lines(process) -> list[dict]:
    return [json.loads(line) for line in process.output().splitlines() if line.startswith('{"time"')]


def test_one_json_log_line_per_request_without_the_token(stub, make_proxy):
    proxy = make_proxy(stub.url)
    token = make_token({"team_id": "log-team", "token_id": "log-token"})
    response = requests.post(
        proxy.url + "/stream?id=log&chunks=3&delay=0.05&text=logged", headers=bearer(token), timeout=10
    )
    assert response.status_code == 200
    requests.get(proxy.url + "/echo", timeout=10)  # 401
    # The stream's line is written when its generator closes, which may come after the 401's line; the
    # readiness probes' /health requests write none (a probe every few seconds would flood the log).
    by_path: dict[str, dict] = {}

    def both_logged() -> bool:
        by_path.update((line["path"], line) for line in _log_lines(proxy))
        return {"/stream", "/echo"} <= by_path.keys()

    assert wait_for(both_logged, 10, 0.1), by_path
    streamed, rejected = by_path["/stream"], by_path["/echo"]
    assert streamed["team_id"] == "log-team" and streamed["token_id"] == "log-token"
    assert streamed["method"] == "POST" and streamed["status"] == 200
    assert streamed["bytes"] == len(response.content)
    assert streamed["request_id"] == response.headers["X-Request-Id"]
    # logged when the stream ended, not when it started: a lower bound (its two 50 ms pauses), which load only raises
    assert streamed["duration_ms"] >= 100
    assert {"time", "client"} <= streamed.keys()
    assert rejected["status"] == 401 and rejected["team_id"] is None and "missing" in rejected["error"]
    assert token not in proxy.output()
    assert token.split(".")[2] not in proxy.output()
    assert "/health" not in by_path  # the readiness probes the start made


def _raw_answer(port: int, request: bytes) -> tuple[int, dict]:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split()[1]), json.loads(body)


def test_gunicorns_own_errors_are_json(proxy):
    """A request gunicorn refuses before the app runs (a bad request line, a header line over its limit) gets
    JSON, not gunicorn's HTML page."""
    status, body = _raw_answer(proxy.port, b"NOT A REQUEST LINE\r\n\r\n")
    assert status == 400 and body["status_code"] == 400 and "Invalid" in body["message"]
    status, body = _raw_answer(proxy.port, b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10000 + b"\r\n\r\n")
    assert status in (400, 431) and body["status_code"] == status


def test_a_chunked_body_within_the_limit_is_forwarded_whole(proxy):
    import base64

    response = requests.post(
        proxy.url + "/echo", data=iter([b"part one, ", b"part two"]), headers=bearer(make_token()), timeout=10
    )
    assert response.status_code == 200
    assert base64.b64decode(response.json()["body"]) == b"part one, part two"
