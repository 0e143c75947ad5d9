"""API errors and the JSON bodies they become. Every error the server sends is JSON, never HTML.

The body's shape is the API family's (``error_shapes``): the family of the handling route, set by its
blueprint (or by a route that tells dialects apart by the body); for unrouted paths, the family the path
belongs to.
"""
from __future__ import annotations

import logging

from flask import Flask, g, jsonify, request
from werkzeug.exceptions import HTTPException

from .error_shapes import api_of, error_body, status_for

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


def request_api() -> str:
    """The API family of the current request."""
    return g.get("api") or api_of(request.path)


def body_of(api: str, err: ApiError) -> dict:
    return error_body(api, err.status, err.message, param=err.param, code=err.code)


def error_response(err: ApiError):
    api = request_api()
    response = jsonify(body_of(api, err))
    response.status_code = status_for(api, err.status)
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
