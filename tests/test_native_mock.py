"""The native HTTP API over the mock backend: errors, limits, cancellation, clean-up, backend death."""

from __future__ import annotations

import json
import os
import signal
import socket

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from servers import ServerProcess, alive, native, wait_for


def test_streams_the_echo_with_utf8_intact(mock_server, model_name):
    r = native(mock_server, model_name, {"text": "héllo 日本", "max_tokens": 30}, stream=True)
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert r.headers["Transfer-Encoding"] == "chunked"
    chunks = list(r.raw.read_chunked(decode_content=False))
    pieces = [c.decode("utf-8") for c in chunks]  # strict: no HTTP chunk splits a character
    assert len(pieces) > 5
    assert "".join(pieces) == "Echo: héllo 日本 — Echo: "


def test_max_tokens_and_stop_sequence(mock_server, model_name):
    r = native(mock_server, model_name, {"text": "abc", "max_tokens": 9, "stream": False})
    assert r.json() == {"text": "Echo: abc", "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 9}
    r = native(mock_server, model_name, {"text": "abc", "stop_sequence": ["bc", "zz"], "stream": False})
    assert r.json()["text"] == "Echo: a" and r.json()["finish_reason"] == "stop"
    r = native(mock_server, model_name, {"text": "abc", "stop_sequence": " a", "return_prompt": True})
    assert r.text == "abcEcho:"


@pytest.mark.parametrize(
    "kwargs,status,fragment",
    [
        (dict(data="{not json", headers={"Content-Type": "application/json"}), 400, "Malformed JSON"),
        (dict(data="[" * 5000, headers={"Content-Type": "application/json"}), 400, "nested too deeply"),
        (dict(data="[1, 2]", headers={"Content-Type": "application/json"}), 400, "JSON object"),
        (dict(data='{"text": "hi"}', headers={"Content-Type": "text/plain"}), 400, "Content-Type"),
        (dict(json={"text": "hi", "top_k": "many"}), 400, "top_k"),
        (dict(json={"text": "hi", "max_tokens": 5000}), 400, "max_tokens"),
        (
            dict(data=b'{"text": "' + b"x" * (2 << 20) + b'"}', headers={"Content-Type": "application/json"}),
            413,
            "large",
        ),
        # the same without a Content-Length (chunked): refused too, never cut and served
        (
            dict(data=iter([b'{"text": "', b"x" * (2 << 20), b'"}']), headers={"Content-Type": "application/json"}),
            413,
            "large",
        ),
    ],
)
def test_bad_requests_get_json_errors(mock_server, model_name, kwargs, status, fragment):
    r = requests.post(f"{mock_server.url}/inference/{model_name}", timeout=30, **kwargs)
    assert r.status_code == status
    assert r.headers["Content-Type"] == "application/json"
    assert r.json()["status_code"] == status and fragment in r.json()["message"]


def test_unknown_model_path_and_method(mock_server, model_name):
    r = native(mock_server, "falcon40b", {"text": "hi"})
    assert r.status_code == 404 and "falcon40b" in r.json()["message"]
    r = requests.get(f"{mock_server.url}/inference/{model_name}", timeout=10)
    assert r.status_code == 405 and r.json()["status_code"] == 405
    r = requests.get(f"{mock_server.url}/no/such/path", timeout=10)
    assert r.status_code == 404 and r.json() == {"status_code": 404, "message": "not found"}


def send_request(server, model_name, text, max_tokens) -> socket.socket:
    """A streaming request on a raw socket, nothing of the answer read: the test controls when the client goes."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    body = json.dumps({"text": text, "max_tokens": max_tokens}).encode()
    sock.sendall(
        f"POST /inference/{model_name} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def open_stream(server, model_name, text, max_tokens=2000):
    """A raw socket streaming request, its answer under way (its headers read)."""
    sock = send_request(server, model_name, text, max_tokens)
    assert b"200 OK" in sock.recv(4096)
    return sock


def test_queue_full_is_answered_at_once_and_disconnects_free_everything(mock_server, model_name):
    # 4 rows + 4 queue places: fill them all, the rows with streams of 40 s (2000 tokens at 50 a second)
    socks = [open_stream(mock_server, model_name, f"user {i}") for i in range(4)]
    socks += [send_request(mock_server, model_name, f"waiter {i}", 10) for i in range(4)]
    try:
        assert wait_for(lambda: mock_server.health()["open_sessions"] == 8, 10), mock_server.health()
        health = mock_server.health()
        assert health["rows_in_use"] == 4 and health["open_sessions"] == 8
        r = native(mock_server, model_name, {"text": "one too many"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["status_code"] == 503 and "busy" in r.json()["message"]
        # answered at once, without waiting for a place: every request that held one still holds it (the streams
        # have most of their 40 s to go, no waiter has got a row), so no place had been freed when it came
        health = mock_server.health()
        assert (health["rows_in_use"], health["open_sessions"]) == (4, 8), health
    finally:  # every client leaves: rows and sessions are freed within a step or two
        for sock in socks:
            sock.close()
    health = mock_server.wait_idle(timeout=10)
    assert health["rows_in_use"] == 0 and health["open_sessions"] == 0 and health["queue_length"] == 0
    assert native(mock_server, model_name, {"text": "after", "max_tokens": 4}).text == "Echo"


def test_mixed_finished_failed_and_abandoned_leave_no_state(mock_server, model_name):
    native(mock_server, model_name, {"text": "done", "max_tokens": 3})
    native(mock_server, model_name, {"text": "bad", "top_p": 7})
    r = native(mock_server, model_name, {"text": "abandon", "max_tokens": 500}, stream=True)
    next(r.iter_content(chunk_size=None))
    r.close()
    r = native(mock_server, model_name, {"text": "half read", "max_tokens": 500}, stream=True)
    r.raw.read(3)
    r.close()
    health = mock_server.wait_idle(timeout=10)
    assert health["open_sessions"] == 0 and health["rows_in_use"] == 0


def test_engine_death_ends_streams_with_an_error_and_a_new_engine_takes_over(model_name):
    with ServerProcess("--mock", "--mock-tokens-per-second", "20") as server:
        r = native(server, model_name, {"text": "doomed", "max_tokens": 1000}, stream=True)
        chunks = r.iter_content(chunk_size=None)
        assert next(chunks)
        before = counters(server)
        old_pid = server.health()["backend_pid"]
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            for _ in chunks:  # the stream is cut, not ended as if complete
                pass
        states = set()

        def ready() -> requests.Response | None:
            health = requests.get(server.url + "/health", timeout=5)
            states.add((health.status_code, health.json()["status"]))
            return health if health.status_code == 200 else None

        health = wait_for(ready, 60)
        assert health, states
        assert (503, "restarting") in states, states
        body = health.json()
        assert health.status_code == 200 and body["status"] == "ready"
        assert body["backend_pid"] != old_pid and body["engine_restarts"] == 1
        assert native(server, model_name, {"text": "after", "max_tokens": 4}).text == "Echo"
        metrics = requests.get(server.url + "/metrics", timeout=5).text
        assert "inference_engine_restarts_total 1.0" in metrics
        after = counters(server)  # the new engine counts from zero: what it counted adds to what the old one did
        assert all(after[name] >= value for name, value in before.items()), (before, after)
        assert after["inference_prefix_cache_queries_total"] == before["inference_prefix_cache_queries_total"] + 5
        assert server.wait_idle()["open_sessions"] == 0


def counters(server) -> dict[str, float]:
    """The server's unlabelled counters (``*_total``) by name."""
    text = requests.get(server.url + "/metrics", timeout=5).text
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.endswith("_total") and not s.labels
    }


def test_stopping_the_server_stops_the_engine_process(model_name):
    server = ServerProcess("--mock")
    engine_pid = server.health()["backend_pid"]
    server.proc.send_signal(signal.SIGTERM)  # to gunicorn's master only, as a process manager would
    server.proc.wait(30)
    server.stop()
    assert wait_for(lambda: not alive(engine_pid), 15, 0.2), "the engine process outlived the server"


def test_gunicorns_own_errors_are_json(mock_server):
    import socket

    with socket.create_connection(("127.0.0.1", mock_server.port), timeout=10) as sock:
        sock.sendall(b"NOT A REQUEST LINE\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), head
    assert json.loads(body)["status_code"] == 400


def test_a_chunked_body_within_the_limit_is_served(mock_server, model_name):
    """A body without a Content-Length reaches the route whole (the capped read stands in for the stream)."""
    r = requests.post(
        f"{mock_server.url}/inference/{model_name}",
        data=iter([b'{"text": "hi",', b' "max_tokens": 3}']),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 200 and r.text == "Ech"
