"""Server-sent events (OpenAI, Anthropic, TGI, llama-stack, shortfin): the framing of one event, no transport (the
streaming response is ``dialects.http.sse_response``)."""

from __future__ import annotations

import json


def sse(data: dict | str, event: str | None = None) -> bytes:
    """One ``data:`` event; a string is sent as is (OpenAI's ``[DONE]``); ``event``: its type line (Anthropic's
    typed events)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()
