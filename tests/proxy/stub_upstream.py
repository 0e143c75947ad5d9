"""A tiny stand-in upstream for the proxy tests: a threaded HTTP/1.1 server on loopback, run in the test process.

Paths (any method):
  GET /health              JSON like the inference server's health (open_sessions = streams in progress)
  /stream?id=&chunks=&delay=&text=[&type=][&gate=]
                           chunked body "<text> <i>\\n" per chunk, `delay` seconds apart (with `gate`, the chunks
                           after the first wait until the test opens that gate); progress and whether the reader
                           went away are recorded in `StubUpstream.streams[id]`
  /sized?id=&chunks=&delay=[&gate=]  the same with a Content-Length instead of chunking
  /utf8                    chunked body whose chunk boundaries split multi-byte characters
  /gzip                    a gzip-encoded body with Content-Encoding: gzip
  /slow-headers?gate=      sends no response until the test opens the gate (then `streams[gate].sent` counts it)
  /status/<code>           that status with a JSON body and a Retry-After header
  (everything)             503 with Retry-After: 2 while `overloaded` is set
  anything else            JSON echo of the method, raw target, headers and body (base64)
"""

from __future__ import annotations

import base64
import gzip
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from servers import Stopped

UTF8_TEXT = "héllo 日本 ✓ — done"
GATE_TIMEOUT = 60  # a gate never opened: the stub goes on after this long (the tests' own timeouts are shorter)
GZIP_TEXT = b"compressed " * 200


def utf8_pieces() -> list[bytes]:
    """UTF8_TEXT cut into pieces that each end inside a multi-byte character where possible."""
    data = UTF8_TEXT.encode()
    cuts = [2, 8, 10, 14, 20, len(data)]  # 2: inside "é"; 8, 10: inside "日", "本"; 14: inside "✓"; 20: inside "—"
    return [data[a:b] for a, b in zip([0] + cuts, cuts)]


@dataclass
class StreamRecord:
    sent: int = 0  # chunks written so far
    done: bool = False  # every chunk was written
    reader_gone: bool = False  # a write failed: the reader (the proxy) closed the connection


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the load test opens many connections at once


class StubUpstream(Stopped):
    def __init__(self):
        self.streams: dict[str, StreamRecord] = {}
        self.seen: list[str] = []  # every request target received, in order
        self.overloaded = False  # when set, every request is answered 503 with Retry-After (a full queue)
        self.gates: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), _make_handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def record(self, stream_id: str) -> StreamRecord:
        with self.lock:
            return self.streams.setdefault(stream_id, StreamRecord())

    def open_streams(self) -> int:
        with self.lock:
            return sum(1 for r in self.streams.values() if r.sent and not r.done and not r.reader_gone)

    def gate(self, name: str) -> threading.Event:
        """A gate the stub waits at (``gate=name`` in a target) until the test opens it (``.set()``)."""
        with self.lock:
            return self.gates.setdefault(name, threading.Event())

    def stop(self) -> None:
        for gate in list(self.gates.values()):
            gate.set()
        self.server.shutdown()
        self.server.server_close()


def _make_handler(stub: StubUpstream):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 60  # idle keep-alive connections end eventually

        def log_message(self, *args) -> None:  # quiet
            pass

        def _dispatch(self) -> None:
            with stub.lock:
                stub.seen.append(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                if stub.overloaded:
                    self._json(503, {"status_code": 503, "message": "overloaded"}, {"Retry-After": "2"})
                elif url.path == "/health" and self.command == "GET":
                    self._json(
                        200,
                        {
                            "status": "ready",
                            "model": "stub-model",
                            "rows_in_use": 0,
                            "queue_length": 0,
                            "open_sessions": stub.open_streams(),
                        },
                    )
                elif url.path == "/stream":
                    self._stream(query, chunked=True)
                elif url.path == "/sized":
                    self._stream(query, chunked=False)
                elif url.path == "/utf8":
                    self._start(200, {"Content-Type": "text/plain; charset=utf-8", "Transfer-Encoding": "chunked"})
                    for piece in utf8_pieces():
                        self._chunk(piece)
                        time.sleep(0.05)
                    self._chunk(b"")
                elif url.path == "/gzip":
                    data = gzip.compress(GZIP_TEXT)
                    self._start(
                        200,
                        {"Content-Type": "text/plain", "Content-Encoding": "gzip", "Content-Length": str(len(data))},
                    )
                    self.wfile.write(data)
                elif url.path == "/slow-headers":
                    stub.gate(query["gate"]).wait(GATE_TIMEOUT)
                    self._json(200, {"slow": True})
                    with stub.lock:
                        stub.streams.setdefault(query["gate"], StreamRecord()).sent += 1
                elif url.path.startswith("/status/"):
                    code = int(url.path.rsplit("/", 1)[1])
                    self._json(code, {"status": code}, {"Retry-After": "7"})
                else:
                    self._json(
                        200,
                        {
                            "method": self.command,
                            "target": self.path,
                            "headers": [[k, v] for k, v in self.headers.items()],
                            "body": base64.b64encode(body).decode(),
                        },
                        # hop-by-hop response headers the proxy must drop; the X-Stub one it must keep
                        {
                            "X-Stub": "yes",
                            "Set-Cookie": "session=user-a; Path=/",
                            "Keep-Alive": "timeout=60",
                            "X-Stub-Hop": "1",
                            "Connection": "keep-alive, X-Stub-Hop",
                        },
                    )
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _dispatch

        def do_HEAD(self) -> None:
            with stub.lock:
                stub.seen.append(self.path)
            self._start(200, {"Content-Type": "text/plain", "Content-Length": "42", "X-Stub": "head"})

        def _start(self, status: int, headers: dict[str, str]) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()

        def _json(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(payload).encode()
            self._start(
                status, {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}
            )
            self.wfile.write(data)

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _stream(self, query: dict[str, str], chunked: bool) -> None:
            stream_id = query.get("id", "anonymous")
            chunks, delay, text = int(query.get("chunks", "3")), float(query.get("delay", "0.1")), query.get("text", "")
            pieces = [f"{text} {i}\n".encode() for i in range(chunks)]
            record = stub.record(stream_id)
            headers = {"Content-Type": query.get("type", "text/plain; charset=utf-8")}
            if chunked:
                headers["Transfer-Encoding"] = "chunked"
            else:
                headers["Content-Length"] = str(sum(map(len, pieces)))
            self._start(200, headers)
            gate = stub.gate(query["gate"]) if "gate" in query else None
            try:
                for i, piece in enumerate(pieces):
                    if i and gate is not None:
                        gate.wait(GATE_TIMEOUT)
                    elif i:
                        time.sleep(delay)
                    if chunked:
                        self._chunk(piece)
                    else:
                        self.wfile.write(piece)
                        self.wfile.flush()
                    with stub.lock:
                        record.sent += 1
                if chunked:
                    self._chunk(b"")
                with stub.lock:
                    record.done = True
            except (BrokenPipeError, ConnectionResetError):
                with stub.lock:
                    record.reader_gone = True
                self.close_connection = True

    return Handler
