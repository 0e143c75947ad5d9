"""Errors the proxy answers itself, always as JSON ``{"status_code": N, "message": "..."}``, never HTML.

Under ``/v1/`` and on TGI's routes the body also carries the ``error`` field that the openai and
text-generation clients read, so each client raises its own error type with the proxy's reason.
"""
from __future__ import annotations

import logging

from flask import Flask, g, jsonify, request
from werkzeug.exceptions import HTTPException

from .auth import AuthError

log = logging.getLogger("proxy")


class ProxyError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, fields: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.fields = fields or {}  # extra top-level body fields, e.g. the draining /health's "status"


_TGI_PATHS = frozenset({"/", "/generate", "/generate_stream", "/info"})
_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_body(path: str, status: int, message: str) -> dict:
    body = {"status_code": status, "message": message}
    if path.startswith("/v1/"):
        kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        body["error"] = {"message": message, "type": kind, "param": None, "code": None}
    elif path in _TGI_PATHS:
        body["error"] = message
    return body


def error_response(status: int, message: str, headers: dict[str, str] | None = None, fields: dict | None = None):
    g.error = message  # for the access log
    response = jsonify({**error_body(request.path, status, message), **(fields or {})})
    response.status_code = status
    response.headers.update(headers or {})
    return response


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(AuthError)
    def unauthorized(exc: AuthError):
        # RFC 6750: a bare challenge when no credentials came, error="invalid_token" when they were bad
        challenge = 'Bearer realm="inference"'
        if request.headers.get("Authorization"):
            challenge += ', error="invalid_token"'
        # answered without reading the body, and the connection closed: a client that sends a large body (or
        # sends it slowly) with a bad token costs nothing more
        return error_response(401, exc.message, {"WWW-Authenticate": challenge, "Connection": "close"})

    @app.errorhandler(ProxyError)
    def proxy_error(exc: ProxyError):
        return error_response(exc.status, exc.message, exc.headers, exc.fields)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        status = exc.code or 500
        message = {405: f"method {request.method} not allowed", 413: "request body too large"}.get(
            status, exc.description or exc.name)
        headers = {}
        if status == 405 and getattr(exc, "valid_methods", None):
            headers["Allow"] = ", ".join(exc.valid_methods)
        return error_response(status, message, headers)

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(500, "internal proxy error")
