"""Forwarding to the upstream server: header rewriting, the upstream call, and the pass-through body stream."""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from http.cookiejar import DefaultCookiePolicy
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter

from lifecycle.internal import INTERNAL_HEADER

from .auth import Identity
from .config import ProxyConfig
from .errors import ProxyError

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# set by the proxy itself (or by requests from the body), never copied from the client
_REPLACED_REQUEST = frozenset(
    {
        "host",
        "authorization",
        "x-api-key",  # Anthropic's clients' form of the token: checked here, never passed on
        "content-length",
        "expect",
        "x-team-id",
        "x-token-id",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "x-request-id",
        # a client's word on its address, path or mount point is not passed on as fact
        "forwarded",
        "x-real-ip",
        "x-original-url",
        "x-rewrite-url",
        "script_name",
        "script-name",
        "x-forwarded-prefix",
        INTERNAL_HEADER.lower(),
    }
)
# gunicorn writes its own Date and Server; two of each would confuse clients
_REPLACED_RESPONSE = frozenset({"date", "server", "x-request-id"})
READ_SIZE = 64 * 1024


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    """Header names listed in Connection: hop-by-hop too (RFC 9110 7.6.1)."""
    return {
        token.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
        if token.strip()
    }


def upstream_request_headers(
    client_headers: Iterable[tuple[str, str]],
    *,
    client_addr: str | None,
    scheme: str,
    request_id: str,
    identity: Identity | None,
    upstream_host: str | None = None,
    internal_secret: str | None = None,
) -> dict[str, str]:
    """The headers sent upstream. Host is the chosen upstream's (``Upstream.send`` sets it when not given here)."""
    client_headers = list(client_headers)
    dropped = HOP_BY_HOP | _REPLACED_REQUEST | _connection_tokens(client_headers)
    headers: dict[str, str] = {}
    for name, value in client_headers:
        if name.lower() not in dropped:
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
    headers["X-Forwarded-For"] = client_addr or "unknown"  # the peer this proxy saw, never a client's claim
    headers["X-Forwarded-Proto"] = scheme
    original_host = next((v for n, v in client_headers if n.lower() == "host"), None)
    if original_host:
        headers["X-Forwarded-Host"] = original_host
    headers["X-Request-Id"] = request_id
    if upstream_host is not None:
        headers["Host"] = upstream_host
    if internal_secret:  # the server answers only requests that carry it (a client's own copy was dropped)
        headers[INTERNAL_HEADER] = internal_secret
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


LOG = logging.getLogger("proxy.upstream")
MAX_COOLDOWN = 60.0  # the longest an upstream is skipped, however often it failed


@dataclass(eq=False)
class Backend:
    """One upstream server address, with the requests this proxy has open on it."""

    url: str  # where requests go: scheme://address:port[/prefix]
    host: str  # the Host header: host[:port] as configured (a name stays a name)
    open: int = 0
    failures: int = 0  # consecutive refusals; each doubles the cooldown
    down_until: float = 0.0  # skipped while the clock is before this


@dataclass(eq=False)
class _Origin:
    """One configured upstream URL and the backends its host name resolved to."""

    url: str
    backends: list[Backend] = field(default_factory=list)
    next_resolve: float = 0.0  # inf: an address literal, never looked up


class UpstreamPool:
    """The upstream servers of this proxy. ``pick`` hands out the healthy one with the fewest requests open through
    this proxy (ties in turn); an upstream that refused a connection or answered 503 is skipped for a cooldown
    that doubles with each further refusal, then tried again. Host names are looked up again every
    ``resolve_interval`` seconds, so a name with one address per server (a Kubernetes headless Service,
    a compose service with replicas) follows the servers as they come and go."""

    def __init__(
        self,
        urls: Iterable[str],
        *,
        cooldown: float,
        resolve_interval: float,
        resolver: Callable = socket.getaddrinfo,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._cooldown = cooldown
        self._resolve_interval = resolve_interval
        self._resolver = resolver
        self._clock = clock
        self._lock = threading.Lock()
        self._resolving = False
        self._turn = 0
        self._origins = [_Origin(url) for url in urls]
        for origin in self._origins:
            if _address_literal(origin.url):
                origin.backends = [Backend(origin.url, urlsplit(origin.url).netloc)]
                origin.next_resolve = float("inf")
        self._refresh(force=True)

    def backends(self) -> list[Backend]:
        with self._lock:
            return [b for origin in self._origins for b in origin.backends]

    def pick(self, tried: set[Backend]) -> Backend | None:
        """The upstream for the next attempt, its open count already raised; None when every one was tried.
        Upstreams in their cooldown come last, soonest-back first: a request is never refused only because
        every upstream failed recently."""
        self._refresh()
        now = self._clock()
        with self._lock:
            backends = [b for origin in self._origins for b in origin.backends if b not in tried]
            if not backends:
                return None
            self._turn += 1
            n = len(backends)
            healthy = [(b.open, (i - self._turn) % n, b) for i, b in enumerate(backends) if b.down_until <= now]
            if healthy:
                backend = min(healthy, key=lambda t: t[:2])[2]
            else:
                backend = min(backends, key=lambda b: b.down_until)
            backend.open += 1
            return backend

    def release(self, backend: Backend) -> None:
        with self._lock:
            backend.open -= 1

    def succeeded(self, backend: Backend) -> None:
        with self._lock:
            backend.failures = 0
            backend.down_until = 0.0

    def failed(self, backend: Backend, reason: str, retry_after: float = 0.0) -> None:
        """Skip the upstream for a while: the cooldown, doubled each time it fails again once its cooldown is over
        (requests that were already open on it and fail together count once), at least its Retry-After."""
        with self._lock:
            now = self._clock()
            if now >= backend.down_until:
                backend.failures += 1
            seconds = min(max(self._cooldown * 2 ** min(backend.failures - 1, 4), retry_after), MAX_COOLDOWN)
            backend.down_until = max(backend.down_until, now + seconds)
        LOG.warning("upstream %s (%s) skipped for %.0f s: %s", backend.url, backend.host, seconds, reason)

    def _refresh(self, force: bool = False) -> None:
        """Look up the host names that are due; keep each address's Backend (and its counts) across look-ups."""
        now = self._clock()
        with self._lock:
            due = [o for o in self._origins if o.next_resolve != float("inf") and (force or now >= o.next_resolve)]
            if not due or (self._resolving and not force):
                return
            self._resolving = True
        found = {}
        try:
            found = {origin.url: self._resolve(origin.url) for origin in due}
        finally:
            with self._lock:
                self._resolving = False
                self._update(due, found, now)

    def _update(self, due: list[_Origin], found: dict[str, list[str] | None], now: float) -> None:
        for origin in due:
            urls = found.get(origin.url)
            if urls is None:  # the look-up failed: keep what we had, try again soon
                origin.next_resolve = now + min(1.0, self._resolve_interval)
                continue
            known = {b.url: b for b in origin.backends}
            host = urlsplit(origin.url).netloc
            origin.backends = [known.get(url) or Backend(url, host) for url in urls]
            origin.next_resolve = now + self._resolve_interval

    def _resolve(self, url: str) -> list[str] | None:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            infos = self._resolver(parts.hostname, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            LOG.warning("cannot resolve upstream %s: %s", url, exc)
            return None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        # a dual-stack name lists each server twice (IPv4 and IPv6): count each server once
        ipv4 = [a for a in addresses if ":" not in a]
        suffix = parts.path
        return [f"{parts.scheme}://{f'[{a}]' if ':' in a else a}:{port}{suffix}" for a in (ipv4 or addresses)]


def _address_literal(url: str) -> bool:
    """An IP address (no look-up), or https (the certificate names the host, so the name is kept)."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        return True
    if parts.hostname is None:
        return False
    try:
        ipaddress.ip_address(parts.hostname)
        return True
    except ValueError:
        return False


@dataclass
class Forwarded:
    """An upstream's answer (its headers are in) and which upstream gave it. ``release`` ends its open count."""

    response: requests.Response
    upstream: str
    attempts: int
    release: Callable[[], None]


class Upstream:
    """The pool of upstream servers and one pooled requests session to them, shared by all threads."""

    def __init__(self, config: ProxyConfig, pool: UpstreamPool | None = None):
        self._config = config
        self.pool = pool or UpstreamPool(
            config.upstreams, cooldown=config.upstream_cooldown, resolve_interval=config.upstream_resolve_interval
        )
        self._session = requests.Session()
        self._session.headers.clear()  # no default Accept-Encoding/User-Agent: forward only what the client sent
        self._session.trust_env = False  # no proxies or netrc from the environment
        # the session is shared by all users: it must never remember one user's Set-Cookie and send it for another
        self._session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
        adapter = HTTPAdapter(pool_connections=64, pool_maxsize=config.threads, max_retries=0)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)

    def send(self, method: str, target: str, headers: Mapping[str, str], body: bytes) -> Forwarded:
        """Send the request to the least busy healthy upstream; return once its response headers are in.

        Nothing has reached the client yet, so an upstream that refuses the connection, drops it before
        answering (it died, or was killed with the request in its queue) or answers 503 is skipped and the
        request goes to the next one. When every upstream was tried, the last 503 is passed on, else a 502/504
        ProxyError. A first-byte timeout is not retried: the request may be running there."""
        c = self._config
        tried: set[Backend] = set()
        refused: ProxyError | None = None
        held: Forwarded | None = None  # the latest 503, passed on if no upstream does better
        while (backend := self.pool.pick(tried)) is not None:
            tried.add(backend)
            try:
                response = self._session.request(
                    method,
                    backend.url + target,
                    headers={**headers, "Host": backend.host},
                    data=body or None,
                    stream=True,
                    allow_redirects=False,
                    timeout=(c.connect_timeout, c.first_byte_timeout),
                )
            except requests.ReadTimeout:
                self.pool.release(backend)
                if held:
                    held.release()
                raise ProxyError(504, f"upstream did not start answering within {c.first_byte_timeout:g} s") from None
            except requests.RequestException as exc:
                self.pool.release(backend)
                if isinstance(exc, requests.ConnectTimeout):
                    refused = ProxyError(504, f"upstream did not accept the connection within {c.connect_timeout:g} s")
                else:
                    refused = ProxyError(502, f"upstream unreachable: {_reason(exc)}")
                self.pool.failed(backend, refused.message)
                continue
            release = _once(response, functools.partial(self.pool.release, backend))
            answer = Forwarded(response, backend.url, len(tried), release)
            if response.status_code == 503:
                self.pool.failed(backend, "answered 503", _seconds(response.headers.get("Retry-After")))
                if held:
                    held.release()
                held = answer
                continue
            self.pool.succeeded(backend)
            if held:
                held.release()
            self._set_stream_timeout(response)
            return answer
        if held is not None:
            held.attempts = len(tried)
            return held
        raise refused or ProxyError(502, "no upstream address: " + ", ".join(c.upstreams) + " did not resolve")

    def _set_stream_timeout(self, response: requests.Response) -> None:
        """Headers are in: from now on only a silence longer than stream_idle_timeout cuts the stream."""
        connection = getattr(response.raw, "connection", None)
        sock = getattr(connection, "sock", None)
        if sock is not None:
            sock.settimeout(self._config.stream_idle_timeout or None)


def _once(response: requests.Response, release: Callable[[], None]) -> Callable[[], None]:
    """Close the response and end its open count, once, whoever calls first."""
    lock = threading.Lock()
    done: list[bool] = []

    def close() -> None:
        with lock:
            if done:
                return
            done.append(True)
        try:
            response.close()
        finally:
            release()

    return close


def _seconds(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0


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
