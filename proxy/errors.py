"""Errors the proxy answers itself, always JSON, never HTML, in the shape of the API the request was for.

The shapes are the server's own (``lifecycle.error_shapes``, pure Python: no torch, no Flask), so each
client raises the same exception type for a proxy error as for the server's (a 429 here and the server's
503 both make the text-generation client raise ``OverloadedError``). Paths shared by two dialects
(``/generate``, ``/tokenize``) are told apart by the body, as the server does.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from flask import Flask, Response, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from lifecycle.deadlines import BodyTimeout, Watchdog
from lifecycle.error_shapes import api_of, error_body, status_for

from .auth import AuthError

log = logging.getLogger("proxy")


class ProxyError(Exception):
    def __init__(
        self, status: int, message: str, headers: dict[str, str] | None = None, fields: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.fields = fields or {}  # extra top-level body fields, e.g. the draining /health's "status"


SHAPE_BODY_BYTES = 65536  # a shared path's body is read for its error shape only up to this size...
SHAPE_BODY_SECONDS = 2.0  # ...and only if it arrives within this time: a slow or huge body costs nothing more


def request_api() -> str:
    """The API family of the current request. Only on the shared paths is the body read (and kept), and only a
    small one that arrives at once; otherwise the path decides (every other error is answered unread)."""
    body = None
    if (
        request.path in ("/generate", "/tokenize")
        and request.mimetype == "application/json"
        and (request.content_length or 0) <= SHAPE_BODY_BYTES
    ):
        watchdog: Watchdog = current_app.extensions["watchdog"]
        try:
            data = g.get("body")  # the body the route already read, if it did
            if data is None:
                data = watchdog.read_body(request.environ, lambda: request.get_data(cache=True), SHAPE_BODY_SECONDS)
            body = json.loads(data) if data else None
        except (BodyTimeout, ValueError, RecursionError):  # too slow, not JSON, or nested past the parser's depth
            body = None
    return api_of(request.path, body)


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None, fields: dict[str, Any] | None = None
) -> Response:
    g.error = message  # for the access log
    api = request_api()
    response = jsonify({**error_body(api, status, message), **(fields or {})})
    response.status_code = status_for(api, status)
    response.headers.update(headers or {})
    return response


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(AuthError)
    def unauthorized(exc: AuthError) -> Response:
        # RFC 6750: a bare challenge when no credentials came, error="invalid_token" when they were bad
        challenge = 'Bearer realm="inference"'
        if request.headers.get("Authorization"):
            challenge += ', error="invalid_token"'
        # answered without reading the body (but for a small one on /generate or /tokenize that arrives at once,
        # read for its error shape), and the connection closed: a client that sends a large body (or sends it
        # slowly) with a bad token costs nothing more
        return error_response(401, exc.message, {"WWW-Authenticate": challenge, "Connection": "close"})

    @app.errorhandler(ProxyError)
    def proxy_error(exc: ProxyError) -> Response:
        return error_response(exc.status, exc.message, exc.headers, exc.fields)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        message = {405: f"method {request.method} not allowed", 413: "request body too large"}.get(
            status, exc.description or exc.name
        )
        headers: dict[str, str] = {}
        if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
            headers["Allow"] = ", ".join(exc.valid_methods)
        return error_response(status, message, headers)

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(500, "internal proxy error")
