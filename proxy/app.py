"""The Flask app factory: one catch-all route that authenticates, applies the team limit and forwards."""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from urllib.parse import quote, urlsplit

from flask import Flask, Response, g, request
from werkzeug.routing import BaseConverter

from lifecycle.access_log import AccessLog, request_id
from lifecycle.deadlines import BodyTimeout, Watchdog, close_when_asked, read_capped
from lifecycle.drain import RETRY_AFTER, Drain
from lifecycle.quota import Store, TeamLimits

from .auth import Identity, TokenVerifier, request_token
from .config import ProxyConfig
from .errors import ProxyError, register_error_handlers
from .playground import register_playground
from .upstream import StreamBody, Upstream, client_response_headers, upstream_request_headers

CLOSE = {"Connection": "close"}  # an answer sent without reading the body: gunicorn then does not read it either
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
PUBLIC = {("GET", "/health"), ("HEAD", "/health")}  # answered without a token, and never with a request body
OPERATOR_PATHS = {  # only for a token with the admin claim, whatever the method: every team's traffic (/metrics),
    "/metrics",  # and what changes the server for every team (loading and unloading models and adapters)
    "/models/load",
    "/models/unload",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/lora-adapters",
}


class _AnyPath(BaseConverter):
    """Every path, including the empty one and ones with empty segments (``//``)."""

    regex = ".*"
    part_isolating = False


def create_app(config: ProxyConfig, access_log: AccessLog | None = None) -> Flask:
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]  # app.json is a DefaultJSONProvider, typed as its base
    app.url_map.converters["anypath"] = _AnyPath
    app.url_map.merge_slashes = False
    app.extensions["proxy_config"] = config
    verifier = TokenVerifier(config)
    # per-team open requests, shared by every replica through Redis when configured (lifecycle/quota.py)
    limiter = TeamLimits(Store(config.redis_url), max_concurrent=config.max_concurrent_per_team)
    app.extensions["team_limits"] = limiter
    upstream = Upstream(config)
    access_log = access_log or AccessLog()
    app.extensions["watchdog"] = watchdog = Watchdog()  # read deadlines, also for the error shape's body peek
    active: set[object] = set()  # requests being forwarded or streamed back: what a drain waits for
    streams: set[StreamBody] = set()  # answers being streamed back: what the drain deadline cuts

    def cut(message: str) -> int:
        for stream in list(streams):
            stream.abort()
        return len(streams)

    app.extensions["drain"] = drain = Drain(config.drain_timeout, lambda: len(active), cut)
    app.wsgi_app = close_when_asked(app.wsgi_app)  # type: ignore[method-assign]  # Flask's documented middleware form
    register_error_handlers(app)
    register_playground(app)  # GET / and /playground: the chat page, no token needed to load it

    @app.before_request
    def start() -> None:
        g.started = time.monotonic()
        g.request_id = request_id(None)  # the proxy's own: a client's X-Request-Id is logged apart, never trusted
        g.client_request_id = request.headers.get("X-Request-Id", "")[:128] or None
        if drain.active:
            if (request.method, request.path) in PUBLIC:
                raise ProxyError(503, "draining", {"Retry-After": str(RETRY_AFTER)}, {"status": "draining"})
            raise ProxyError(503, "the proxy is shutting down; retry shortly", {"Retry-After": str(RETRY_AFTER)})

    @app.route("/<anypath:path>", methods=METHODS)
    def forward(path: str):
        identity = None
        public = (request.method, request.path) in PUBLIC
        if public and _declares_body(request.environ):  # refused unread: a public route holds no one's bytes
            raise ProxyError(413, f"{request.method} {request.path} takes no request body", CLOSE)
        authorization, api_key = request.headers.get("Authorization"), request.headers.get("x-api-key")
        if not public or authorization or api_key:  # a public path with a token: verified all the same
            identity = verifier.verify(request_token(authorization, api_key))
        g.identity = identity
        if _normalized(request.path) in OPERATOR_PATHS and not (identity is not None and identity.admin):
            raise ProxyError(403, f"{request.path} is for operators: it needs a token with the admin claim", CLOSE)
        forwarding = object()
        active.add(forwarding)
        slot = None
        try:
            try:
                body = b"" if public else watchdog.read_body(request.environ, read_whole, config.body_timeout)
            except BodyTimeout as exc:
                raise ProxyError(408, str(exc), CLOSE) from None
            g.body = body  # for an error's shape (shared paths)
            # the team's rows from the whole body to the answer's end: a slow upload holds none
            team = identity.team_id if identity is not None else None
            weight = choices_weight(body) if request.method == "POST" else 1
            if limiter.never_fits(team, weight):
                raise ProxyError(
                    400,
                    f"n={weight} exceeds the team's limit of {limiter.max_concurrent} open rows (each choice a request "
                    f"asks for, n or best_of, takes a row); ask for at most {limiter.max_concurrent}",
                )
            slot = limiter.acquire(team, weight)
            if slot is None:
                raise ProxyError(
                    429,
                    f"team {team!r} has no room for {weight} more of its limit of {limiter.max_concurrent} open rows "
                    "(a request takes one per choice, n); retry when one finishes",
                    {"Retry-After": str(config.retry_after)},
                )
            headers = upstream_request_headers(
                request.headers.items(),
                client_addr=request.remote_addr,
                scheme=request.scheme,
                request_id=g.request_id,
                identity=identity,
                internal_secret=config.internal_secret,
            )
            forwarded = upstream.send(request.method, _target(), headers, body)
        except BaseException:
            active.discard(forwarding)
            if slot is not None:
                slot.release()
            raise

        def closed() -> None:
            streams.discard(stream)
            active.discard(forwarding)
            forwarded.release()
            slot.release()

        g.upstream = forwarded
        answer = forwarded.response
        g.stream = stream = StreamBody(answer, on_close=closed)
        streams.add(stream)
        if _details_hidden(identity):  # /health: the status only, unless the caller is an operator
            try:
                raw = b"".join(stream) if request.method == "GET" else b""
            finally:
                stream.close()
            return Response(
                json.dumps({"status": _status_of(raw)}) if request.method == "GET" else b"",
                status=answer.status_code,
                content_type="application/json",
                headers={
                    k: v
                    for k, v in client_response_headers(list(answer.raw.headers.items()))
                    if k.lower() == "retry-after"
                },
            )
        upstream_headers = list(answer.raw.headers.items())
        response = Response(stream, status=answer.status_code, headers=client_response_headers(upstream_headers))
        if not any(name.lower() == "content-type" for name, _ in upstream_headers):
            del response.headers["Content-Type"]  # pass through its absence rather than invent one
        return response

    @app.after_request
    def finish(response: Response) -> Response:
        response.headers["X-Request-Id"] = g.get("request_id") or uuid.uuid4().hex
        identity: Identity | None = g.get("identity")
        stream: StreamBody | None = g.get("stream")
        started = g.get("started", time.monotonic())
        fields = {
            "request_id": response.headers["X-Request-Id"],
            "client_request_id": g.get("client_request_id"),
            "team_id": identity.team_id if identity else None,
            "token_id": identity.token_id if identity else None,
            "method": request.method,
            "path": request.path,
            "status": response.status_code,
            "client": request.remote_addr,
        }
        error = g.get("error")
        forwarded = g.get("upstream")
        if forwarded is not None:
            fields["upstream"] = forwarded.upstream
            if forwarded.attempts > 1:
                fields["attempts"] = forwarded.attempts

        def write() -> None:
            outcome: dict[str, int | str] = {}
            if stream is not None:
                outcome["bytes"] = stream.bytes_sent
                if stream.error:
                    outcome["error"] = stream.error
                elif not stream.complete and stream.bytes_sent:
                    outcome["error"] = "client disconnected"
            else:
                outcome["bytes"] = response.content_length or 0
                if error:
                    outcome["error"] = error
            access_log.write(**fields, **outcome, duration_ms=round((time.monotonic() - started) * 1000, 1))

        if not (request.path == "/health" and request.method in ("GET", "HEAD")):  # probes: not a line each
            response.call_on_close(write)
        return response

    return app


def _target() -> str:
    """The request target as the client sent it (raw path and query), so percent-escapes pass unchanged."""
    raw = request.environ.get("RAW_URI") or request.environ.get("REQUEST_URI") or ""
    if raw.startswith("/"):
        return raw
    if raw.startswith(("http://", "https://")):  # absolute-form target
        parts = urlsplit(raw)
        return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    target = quote(request.environ.get("SCRIPT_NAME", "") + request.environ.get("PATH_INFO", "")) or "/"
    query = request.environ.get("QUERY_STRING")
    return f"{target}?{query}" if query else target


def read_whole() -> bytes:
    """The request's whole body (a chunked one capped as a declared one is), not kept by werkzeug."""
    return read_capped(request, cache=False)


def _declares_body(environ: dict) -> bool:
    """Whether the request says a body follows (a Content-Length above 0, or any Transfer-Encoding): checked on
    the headers alone, so a public route refuses a body without waiting for a byte of it."""
    length = environ.get("CONTENT_LENGTH") or "0"
    return bool(environ.get("HTTP_TRANSFER_ENCODING")) or not (length.isdigit() and int(length) == 0)


def _normalized(path: str) -> str:
    """The path as a server's router may take it (repeated slashes merged, a trailing one dropped), so an operator
    path is not reached by spelling it another way."""
    return re.sub("/+", "/", path).rstrip("/") or "/"


def _details_hidden(identity: Identity | None) -> bool:
    """Whether this is a /health whose answer is cut to its status: the server's pid, model path, memory and
    failure text are for operators (the admin claim), and for the server's own port."""
    is_health = request.method in ("GET", "HEAD") and _normalized(request.path) == "/health"
    return is_health and not (identity is not None and identity.admin)


def choices_weight(body: bytes) -> int:
    """The rows a request asks for, its weight in the team's limit: the largest of ``n`` and ``best_of`` at the top
    of a JSON object (OpenAI, vLLM) and in its ``parameters`` (TGI), 1 when it names none or is not JSON. Counted
    as the server reads them (8, 8.0 and "8" alike), so a request cannot spell its ``n`` around its weight."""
    try:
        parsed = json.loads(body) if body.lstrip()[:1] == b"{" else None
    except (ValueError, RecursionError):
        return 1
    if not isinstance(parsed, dict):
        return 1
    parameters = parsed.get("parameters")
    places = [parsed, parameters] if isinstance(parameters, dict) else [parsed]
    return max([1, *(_count(place.get(name)) for place in places for name in ("n", "best_of"))])


def _count(value: object) -> int:
    """A field's value as the positive integer the server would read it as, else 1 (bool is no number)."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return 1
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 1
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return 1
    return max(1, int(value))


def _status_of(raw: bytes) -> str | None:
    """The "status" of a health answer's JSON body (None when it has none)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    status = body.get("status") if isinstance(body, dict) else None
    return status if isinstance(status, str) else None
