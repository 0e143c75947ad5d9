"""Forwarding to the upstream server: header rewriting, the upstream call, and the pass-through body stream."""
from __future__ import annotations

import errno
from http.cookiejar import DefaultCookiePolicy
from typing import Callable, Iterable, Iterator, Mapping

import requests
from requests.adapters import HTTPAdapter

from .auth import Identity
from .config import ProxyConfig
from .errors import ProxyError

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                        "te", "trailer", "trailers", "transfer-encoding", "upgrade"})
# set by the proxy itself (or by requests from the body), never copied from the client
_REPLACED_REQUEST = frozenset({"host", "authorization", "content-length", "expect", "x-team-id", "x-token-id",
                               "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-request-id"})
# gunicorn writes its own Date and Server; two of each would confuse clients
_REPLACED_RESPONSE = frozenset({"date", "server", "x-request-id"})
READ_SIZE = 64 * 1024


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    """Header names listed in Connection: hop-by-hop too (RFC 9110 7.6.1)."""
    return {token.strip().lower() for name, value in headers if name.lower() == "connection"
            for token in value.split(",") if token.strip()}


def upstream_request_headers(client_headers: Iterable[tuple[str, str]], *, upstream_host: str, client_addr: str | None,
                             scheme: str, request_id: str, identity: Identity | None) -> dict[str, str]:
    client_headers = list(client_headers)
    dropped = HOP_BY_HOP | _REPLACED_REQUEST | _connection_tokens(client_headers)
    headers: dict[str, str] = {}
    for name, value in client_headers:
        if name.lower() not in dropped:
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
    prior = ", ".join(v for n, v in client_headers if n.lower() == "x-forwarded-for")
    client = client_addr or "unknown"
    headers["X-Forwarded-For"] = f"{prior}, {client}" if prior else client
    headers["X-Forwarded-Proto"] = scheme
    original_host = next((v for n, v in client_headers if n.lower() == "host"), None)
    if original_host:
        headers["X-Forwarded-Host"] = original_host
    headers["X-Request-Id"] = request_id
    headers["Host"] = upstream_host
    if identity is not None:
        if identity.team_id is not None:
            headers["X-Team-Id"] = identity.team_id
        if identity.token_id is not None:
            headers["X-Token-Id"] = identity.token_id
    return headers


def client_response_headers(upstream_headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    upstream_headers = list(upstream_headers)
    dropped = HOP_BY_HOP | _REPLACED_RESPONSE | _connection_tokens(upstream_headers)
    return [(name, value) for name, value in upstream_headers if name.lower() not in dropped]


class Upstream:
    """One pooled requests session to the upstream server, shared by all threads."""

    def __init__(self, config: ProxyConfig):
        self._config = config
        self._session = requests.Session()
        self._session.headers.clear()  # no default Accept-Encoding/User-Agent: forward only what the client sent
        self._session.trust_env = False  # no proxies or netrc from the environment
        # the session is shared by all users: it must never remember one user's Set-Cookie and send it for another
        self._session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=config.threads, max_retries=0)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)

    def send(self, method: str, target: str, headers: Mapping[str, str], body: bytes) -> requests.Response:
        """Send the request; return once upstream's response headers are in. Failures become 502/504 ProxyErrors."""
        c = self._config
        try:
            response = self._session.request(method, c.upstream + target, headers=dict(headers), data=body or None,
                                             stream=True, allow_redirects=False,
                                             timeout=(c.connect_timeout, c.first_byte_timeout))
        except requests.ConnectTimeout:
            raise ProxyError(504, f"upstream did not accept the connection within {c.connect_timeout:g} s") from None
        except requests.ReadTimeout:
            raise ProxyError(504, f"upstream did not start answering within {c.first_byte_timeout:g} s") from None
        except requests.RequestException as exc:
            raise ProxyError(502, f"upstream unreachable: {_reason(exc)}") from None
        self._set_stream_timeout(response)
        return response

    def _set_stream_timeout(self, response: requests.Response) -> None:
        """Headers are in: from now on only a silence longer than stream_idle_timeout cuts the stream."""
        connection = getattr(response.raw, "connection", None)
        sock = getattr(connection, "sock", None)
        if sock is not None:
            sock.settimeout(self._config.stream_idle_timeout or None)


def _reason(exc: Exception) -> str:
    text = str(exc)
    if "Connection refused" in text:
        return "connection refused"
    return type(exc).__name__


def _raw_chunks(upstream: requests.Response) -> Iterator[bytes]:
    """The undecoded body, each piece as soon as it arrives (no gzip decoding, no waiting to fill a buffer)."""
    raw = upstream.raw
    if raw.chunked and raw.supports_chunked_reads():
        yield from raw.read_chunked(None, decode_content=False)  # one piece per HTTP chunk
        return
    while True:
        data = raw.read1(READ_SIZE, decode_content=False)  # whatever has arrived, up to READ_SIZE
        if not data:
            return
        yield data


class StreamBody:
    """The upstream body as a WSGI iterable. The server calls close() when the response ends or the client goes
    away (even if iteration never started, e.g. HEAD); close() closes the upstream connection, so the upstream
    server sees the disconnect and frees the user's row, then runs on_close (slot release, access log)."""

    def __init__(self, upstream: requests.Response, on_close: Callable[[], None]):
        self._upstream = upstream
        self._on_close = on_close
        self._closed = False
        self.bytes_sent = 0
        self.complete = False
        self.error: str | None = None

    def __iter__(self) -> Iterator[bytes]:
        try:
            for chunk in _raw_chunks(self._upstream):
                if chunk:
                    self.bytes_sent += len(chunk)
                    yield chunk
            self.complete = True
        except GeneratorExit:
            raise
        except Exception as exc:
            # The client must see the cut, so the response is aborted rather than ended cleanly. gunicorn drops
            # the client connection quietly on ECONNRESET; the access log line carries the reason.
            self.error = f"upstream stream broken: {type(exc).__name__}"
            raise ConnectionResetError(errno.ECONNRESET, self.error) from exc

    def abort(self) -> None:
        """Cut the stream now (the drain deadline): the client sees an incomplete response."""
        self._upstream.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._upstream.close()
        finally:
            self._on_close()
