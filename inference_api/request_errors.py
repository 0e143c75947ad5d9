"""The errors of a request that the server will not run, with no transport: raised by the parsers, the
preparation step, the serving layer and the engine client, alike for the HTTP APIs and the offline ``LLM``.

Each says what went wrong (``kind``) and, where a field is to blame, which (``field``); the HTTP edge
(``errors.py``) turns a kind into a status code and the request's API family into its body, and the offline
API into ``ParameterError`` or ``EngineError``.
"""

from __future__ import annotations


class RequestError(Exception):
    """A bad request: a field out of range, a prompt that does not fit, an unsupported option."""

    kind = "invalid"
    code: str | None = None  # OpenAI's machine-readable error code

    def __init__(self, message: str, field: str | None = None, *, retry_after: int | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.retry_after = retry_after  # seconds after which the same request may succeed


class NotFound(RequestError):
    """The request names something this server does not hold (or not for its team): a model, a stored response."""

    kind = "not_found"


class ModelNotFound(NotFound):
    """The request names a model this server does not serve."""

    code = "model_not_found"


class Conflict(RequestError):
    """The request asks for a change the server's state forbids now: unloading a model or adapter in use."""

    kind = "conflict"


class RateLimited(RequestError):
    """The request's team has used its quota for now (``retry_after``)."""

    kind = "rate_limited"


class Unavailable(RequestError):
    """The engine cannot take or finish the request now: loading, restarting, failed, busy or shutting down."""

    kind = "unavailable"
