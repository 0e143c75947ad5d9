"""Server-sent events (OpenAI, TGI, llama-stack, shortfin): the framing of one event, no transport (the
streaming response is ``dialects.http.sse_response``)."""

from __future__ import annotations

import json


def sse(data: dict | str) -> bytes:
    """One ``data:`` event; a string is sent as is (OpenAI's ``[DONE]``)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
