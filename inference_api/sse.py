"""Streaming responses: server-sent events (OpenAI, TGI, llama-stack, shortfin) and other chunked bodies."""
from __future__ import annotations

import json
from typing import Iterator

from flask import Response, stream_with_context


def sse(data: dict | str) -> bytes:
    """One ``data:`` event; a string is sent as is (OpenAI's ``[DONE]``)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def sse_response(chunks: Iterator[bytes], mimetype: str = "text/event-stream") -> Response:
    """A streaming response, sent piece by piece (no proxy buffering); call inside the request (it keeps the
    request context)."""
    return Response(stream_with_context(chunks), mimetype=mimetype,
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
