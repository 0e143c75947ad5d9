"""API errors and the JSON bodies they become. Every error the server sends is JSON, never HTML."""
from __future__ import annotations

import logging

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.code = code  # OpenAI's machine-readable error code, e.g. "model_not_found"


_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


def api_of(path: str) -> str:
    """The API family a path belongs to: ``openai``, ``tgi``, ``native`` or ``other``."""
    if path.startswith("/v1/"):
        return "openai"
    if path in ("/", "/generate", "/generate_stream", "/info"):  # "/" is TGI's compat route
        return "tgi"
    if path.startswith(("/inference/", "/predictions/")):
        return "native"
    return "other"


def error_body(path: str, err: ApiError) -> dict:
    """The error object of the API family the path belongs to."""
    api = api_of(path)
    if api == "openai":
        return {"error": {"message": err.message, "type": _OPENAI_TYPES.get(err.status, "server_error"),
                          "param": err.param, "code": err.code}}
    if api == "tgi":
        kind = "validation" if err.status in (400, 413, 422) else "overloaded" if err.status in (429, 503) \
            else "generation"
        return {"error": err.message, "error_type": kind}
    return {"status_code": err.status, "message": err.message}


def error_response(err: ApiError):
    response = jsonify(error_body(request.path, err))
    response.status_code = err.status
    if err.retry_after is not None:
        response.headers["Retry-After"] = str(err.retry_after)
    return response


def register_error_handlers(app: Flask) -> None:
    app.register_error_handler(ApiError, error_response)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        message = {404: "not found", 405: f"method {request.method} not allowed",
                   413: "request body too large"}.get(exc.code or 500, exc.description)
        response = error_response(ApiError(exc.code or 500, message))
        if exc.code == 405 and getattr(exc, "valid_methods", None):
            response.headers["Allow"] = ", ".join(exc.valid_methods)
        return response

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        log.exception("unhandled error on %s", request.path)
        return error_response(ApiError(500, "internal server error"))
