"""The one definition of each API family's error body, shared by the server and the proxy.

Pure Python (no Flask, no torch), so the proxy can import it without the server's dependencies. Each
client raises its own exception type from these shapes: ``openai`` reads ``error.type``/status,
``text-generation`` reads ``error_type``, llama-stack-client reads the status and ``detail``, shortfin's
clients read ``error`` and ``code``, ``anthropic`` reads the status and ``error.type``, and the original API's
clients read ``status_code``/``message``.
"""

from __future__ import annotations

from typing import Any

OPENAI, TGI, NATIVE, LLAMA_STACK, SHORTFIN, OTHER = "openai", "tgi", "native", "llama_stack", "shortfin", "other"
ANTHROPIC = "anthropic"
FAMILIES = (OPENAI, ANTHROPIC, TGI, NATIVE, LLAMA_STACK, SHORTFIN, OTHER)

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
# Anthropic's error types by status (its SDK raises by status; the type names the kind)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_TGI_PATHS = frozenset({"/", "/generate", "/generate_stream", "/info"})
# paths whose family depends on the body: TGI sends ``inputs``; shortfin ``text``/``input_ids``; vLLM ``prompt``
_BY_BODY = frozenset({"/generate", "/tokenize"})


def api_of(path: str, body: object = None) -> str:
    """The API family a request belongs to, from its path (and, for shared paths, its JSON body)."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    if path.startswith("/v1/") or path == "/detokenize":
        return OPENAI
    if path in ("/inference/completion", "/inference/chat_completion"):
        return LLAMA_STACK
    if path.startswith(("/inference/", "/predictions/")):
        return NATIVE
    if path in _BY_BODY and isinstance(body, dict) and "inputs" not in body:
        if path == "/tokenize" and ("prompt" in body or "messages" in body):
            return OPENAI  # vLLM's /tokenize answers errors as its OpenAI server does
        if path == "/generate" and ({"text", "input_ids", "sampling_params"} & body.keys()):
            return SHORTFIN
    if path in _TGI_PATHS or path in _BY_BODY:
        return TGI
    return OTHER


def status_for(api: str, status: int) -> int:
    """TGI answers invalid input with 422 where the other APIs use 400."""
    return 422 if api == TGI and status == 400 else status


def tgi_error_type(status: int) -> str | None:
    """TGI's error_type; None where the text-generation client should choose by status (404: NotFoundError,
    504: ShardTimeoutError)."""
    if status in (400, 413, 422):
        return "validation"
    if status in (429, 503):
        return "overloaded"
    return "generation" if status == 500 else None


def shortfin_code(status: int) -> str | None:
    """shortfin's ResponderErrorCodes: INVALID_REQUEST_ARGS (400), QUEUE_FULL (503)."""
    if status in (400, 413, 422):
        return "INVALID_REQUEST_ARGS"
    if status in (429, 503):
        return "QUEUE_FULL"
    return None


def error_body(
    api: str, status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The error object that API family's clients expect."""
    if api == OPENAI:
        kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    if api == ANTHROPIC:
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if api == TGI:
        error_type = tgi_error_type(status)
        return {"error": message, "error_type": error_type} if error_type else {"error": message}
    if api == LLAMA_STACK:
        return {"detail": message}  # FastAPI's HTTPException body, as llama-stack's server sends it
    if api == SHORTFIN:
        return {"error": message, "code": shortfin_code(status)}
    return {"status_code": status, "message": message}
