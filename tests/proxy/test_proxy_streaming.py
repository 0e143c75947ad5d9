"""Streaming through the proxy: unbuffered, byte-exact, disconnects reach upstream, 502/504/429, many streams."""

from __future__ import annotations

import gzip
import http.client
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from proxy_helpers import bearer, free_port, make_token
from servers import wait_for
from stub_upstream import GZIP_TEXT, UTF8_TEXT


def stream_url(proxy, stream_id: str, chunks: int, delay: float, text: str = "tok", **extra) -> str:
    query = "&".join(
        f"{k}={v}" for k, v in {"id": stream_id, "chunks": chunks, "delay": delay, "text": text, **extra}.items()
    )
    return f"{proxy.url}/stream?{query}"


def expected_body(chunks: int, text: str = "tok") -> bytes:
    return b"".join(f"{text} {i}\n".encode() for i in range(chunks))


def echo_status(proxy, token: str) -> int:
    return requests.post(proxy.url + "/echo", headers=bearer(token), timeout=10).status_code


@pytest.mark.timeout(60)
@pytest.mark.parametrize("content_type", ["text/plain; charset=utf-8", "text/event-stream"])
def test_first_chunk_arrives_while_upstream_still_generating(proxy, stub, content_type):
    stream_id = f"first-{uuid.uuid4().hex}"
    response = requests.post(
        stream_url(proxy, stream_id, chunks=3, delay=0, type=content_type, gate=stream_id),
        headers=bearer(make_token()),
        stream=True,
        timeout=30,
    )
    assert response.status_code == 200
    assert response.headers["Content-Type"] == content_type
    pieces = response.iter_content(chunk_size=None)
    first = next(pieces)  # the stub holds the rest until the gate opens: a proxy that buffered would never send it
    record = stub.record(stream_id)
    assert first == b"tok 0\n"
    # (the stub counts a chunk just after its write returns, which can be after the client has read it; the gate
    # keeps it from writing a second one or finishing)
    assert wait_for(lambda: record.sent == 1, 10) and not record.done, "the proxy buffered the stream"
    stub.gate(stream_id).set()
    assert first + b"".join(pieces) == expected_body(3)
    assert wait_for(lambda: record.done, 10)  # the stub marks it done just after its last write


@pytest.mark.timeout(60)
def test_content_length_body_is_not_buffered_either(proxy, stub):
    stream_id = f"sized-{uuid.uuid4().hex}"
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        target = f"/sized?id={stream_id}&chunks=3&delay=0&text=sz&gate={stream_id}"
        conn.request("GET", target, headers=bearer(make_token()))
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Length") == str(len(expected_body(3, "sz")))
        first = response.read1(1 << 16)  # the stub holds the rest until the gate opens
        assert first == b"sz 0\n"
        assert stub.record(stream_id).sent == 1, "the proxy waited for the whole body"
        stub.gate(stream_id).set()
        assert first + response.read() == expected_body(3, "sz")
    finally:
        conn.close()


def test_multibyte_characters_split_across_chunks_arrive_intact(proxy):
    response = requests.get(proxy.url + "/utf8", headers=bearer(make_token()), stream=True, timeout=10)
    raw = b"".join(response.raw.stream(None, decode_content=False))
    assert raw == UTF8_TEXT.encode()
    assert raw.decode("utf-8") == UTF8_TEXT


def test_encoded_bodies_pass_undecoded(proxy):
    response = requests.get(
        proxy.url + "/gzip", headers={**bearer(make_token()), "Accept-Encoding": "gzip"}, stream=True, timeout=10
    )
    raw = response.raw.read(decode_content=False)
    assert response.headers["Content-Encoding"] == "gzip"
    assert response.headers["Content-Length"] == str(len(raw))
    assert gzip.decompress(raw) == GZIP_TEXT


def open_raw_stream(proxy, target: str, token: str, marker: bytes) -> socket.socket:
    """Start a request on a bare socket and read until `marker` arrives (so the stream is flowing)."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=20)
    sock.sendall(
        f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Length: 0\r\n\r\n".encode()
    )
    received = b""
    while marker not in received:
        data = sock.recv(4096)
        assert data, f"connection closed before {marker!r}: {received!r}"
        received += data
    assert received.startswith(b"HTTP/1.1 200"), received
    return sock


@pytest.mark.timeout(60)
def test_client_disconnect_closes_the_upstream_connection_and_frees_the_slot(stub, make_proxy):
    proxy = make_proxy(stub.url, "--max-concurrent-per-team", "1")
    stream_id = f"gone-{uuid.uuid4().hex}"
    token = make_token({"team_id": "solo", "token_id": "t"})
    sock = open_raw_stream(proxy, f"/stream?id={stream_id}&chunks=300&delay=0.1&text=dc", token, b"dc 0")
    busy = requests.get(proxy.url + "/echo", headers=bearer(token), timeout=10)
    assert busy.status_code == 429
    sock.close()
    record = stub.record(stream_id)
    assert wait_for(lambda: record.reader_gone, 20), "upstream never saw the disconnect"
    assert not record.done
    assert wait_for(lambda: echo_status(proxy, token) != 429, 20, 0.1), "the team slot was not released"


def test_upstream_down_is_502(make_proxy):
    proxy = make_proxy(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    for method, path, headers in [("POST", "/inference/m", bearer(make_token())), ("GET", "/health", {})]:
        response = requests.request(method, proxy.url + path, headers=headers, timeout=10)
        assert response.status_code == 502
        assert response.json()["status_code"] == 502
        assert "refused" in response.json()["message"]


@pytest.mark.timeout(90)
def test_slow_upstream_is_504_but_a_flowing_stream_is_never_cut(stub, make_proxy):
    proxy = make_proxy(stub.url, "--first-byte-timeout", "1")
    gate = f"slow-{uuid.uuid4().hex}"
    response = requests.get(f"{proxy.url}/slow-headers?gate={gate}", headers=bearer(make_token()), timeout=30)
    assert response.status_code == 504
    assert response.json()["status_code"] == 504 and "1 s" in response.json()["message"]
    # the upstream holds its headers until the gate opens: the 504 came first, the proxy did not wait for them
    assert stub.record(gate).sent == 0
    stub.gate(gate).set()
    # pauses between chunks longer than the first-byte timeout do not cut a stream that has started
    response = requests.post(
        stream_url(proxy, f"pause-{uuid.uuid4().hex}", chunks=3, delay=2.0), headers=bearer(make_token()), timeout=30
    )
    assert response.status_code == 200 and response.content == expected_body(3)


@pytest.mark.timeout(90)
def test_per_team_limit_is_429_with_retry_after(stub, make_proxy):
    proxy = make_proxy(stub.url, "--max-concurrent-per-team", "2", "--retry-after", "3")
    team_x = make_token({"team_id": "team-x", "token_id": "a"})
    streams = [
        requests.post(
            stream_url(proxy, f"lim-{uuid.uuid4().hex}", chunks=4, delay=0.5),
            headers=bearer(team_x),
            stream=True,
            timeout=30,
        )
        for _ in range(2)
    ]
    for s in streams:
        assert s.status_code == 200
    over = requests.post(
        proxy.url + "/echo", headers=bearer(make_token({"team_id": "team-x", "token_id": "b"})), timeout=10
    )
    assert over.status_code == 429
    assert over.headers["Retry-After"] == "3"
    assert over.json()["status_code"] == 429 and "team-x" in over.json()["message"]
    other = requests.post(
        proxy.url + "/echo", headers=bearer(make_token({"team_id": "team-y", "token_id": "c"})), timeout=10
    )
    assert other.status_code == 200
    for s in streams:
        assert s.content == expected_body(4)  # read to the end: the slots are released
    assert wait_for(lambda: echo_status(proxy, team_x) != 429, 10, 0.1), "slots not released after the streams ended"


@pytest.mark.timeout(180)
def test_64_concurrent_streams_lose_nothing_and_never_mix(proxy, stub):
    count = 64
    barrier = threading.Barrier(count, timeout=60)
    tags = [f"req{i:02d}-{uuid.uuid4().hex[:8]}" for i in range(count)]

    def one(i: int) -> tuple[int, bytes]:
        token = make_token({"team_id": f"team-{i % 8}", "token_id": f"load-{i}"})
        barrier.wait()
        with requests.post(
            stream_url(proxy, tags[i], chunks=5, delay=0.2, text=tags[i]), headers=bearer(token), timeout=60
        ) as response:
            return response.status_code, response.content

    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(one, range(count)))
    for i, (status, body) in enumerate(results):
        assert status == 200
        assert body == expected_body(5, tags[i]), f"stream {i} got {body!r}"


@pytest.mark.timeout(60)
def test_stream_idle_timeout_cuts_visibly(stub, make_proxy):
    """A stream silent for longer than --stream-idle-timeout is cut, and the client sees an incomplete response."""
    proxy = make_proxy(stub.url, "--stream-idle-timeout", "1")
    stream_id = f"idle-{uuid.uuid4().hex}"
    response = requests.post(
        stream_url(proxy, stream_id, chunks=3, delay=0, gate=stream_id),  # silent after its first chunk, until cut
        headers=bearer(make_token()),
        stream=True,
        timeout=30,
    )
    assert response.status_code == 200
    pieces = response.iter_content(chunk_size=None)
    assert next(pieces) == b"tok 0\n"
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        b"".join(pieces)
    assert stub.record(stream_id).sent == 1  # cut while the upstream was silent
    stub.gate(stream_id).set()
    assert wait_for(lambda: '"error":"upstream stream broken' in proxy.output(), 10, 0.1), proxy.output()
