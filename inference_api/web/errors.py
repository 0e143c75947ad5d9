"""The HTTP edge of errors: ``ApiError`` and the JSON bodies errors become. Every error the server sends is JSON,
never HTML.

Everything below the routes raises the transport-free errors of ``request_errors``; this module alone gives
each its status code (``STATUS``, by kind). The body's shape is the API family's (``error_shapes``): the family
of the handling route, fixed where its routes are registered (``answer_as``: the dialect's blueprint, or the
route that tells dialects apart by the body); for unrouted paths, the family the path belongs to.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from lifecycle.error_shapes import api_of, error_body, status_for

from ..request_errors import RequestError

log = logging.getLogger(__name__)

# the status code of each kind of request error
STATUS = {"invalid": 400, "not_found": 404, "conflict": 409, "rate_limited": 429, "unavailable": 503}


class ApiError(Exception):
    """An error with its HTTP status, raised by the HTTP edge itself (the app's admission, Werkzeug's errors)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        retry_after: int | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.code = code  # OpenAI's machine-readable error code, e.g. "model_not_found"

    @classmethod
    def of(cls, err: RequestError) -> ApiError:
        return cls(STATUS[err.kind], err.message, param=err.field, retry_after=err.retry_after, code=err.code)


def answer_as(api: str) -> None:
    """Fix the API family of the current request: the shape of its errors and its label in the metrics."""
    g.api = api


def request_api() -> str:
    """The API family of the current request."""
    api: str | None = g.get("api")
    return api or api_of(request.path)


def body_of(api: str, err: ApiError) -> dict[str, Any]:
    return error_body(api, err.status, err.message, param=err.param, code=err.code)


def error_response(err: ApiError) -> Response:
    api = request_api()
    response = jsonify(body_of(api, err))
    response.status_code = status_for(api, err.status)
    if err.retry_after is not None:
        response.headers["Retry-After"] = str(err.retry_after)
    return response


def register_error_handlers(app: Flask) -> None:
    app.register_error_handler(ApiError, error_response)
    app.register_error_handler(RequestError, lambda err: error_response(ApiError.of(err)))

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        message = {404: "not found", 405: f"method {request.method} not allowed", 413: "request body too large"}.get(
            exc.code or 500, exc.description or exc.name
        )
        response = error_response(ApiError(exc.code or 500, message))
        if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
            response.headers["Allow"] = ", ".join(exc.valid_methods)
        return response

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.path)
        return error_response(ApiError(500, "internal server error"))
