"""LLM inference server: Flask front end, continuous-batching engine in a backend process.

The Python API for offline and embedded use (docs/offline.md): ``from inference_api import LLM, SamplingParams``.
"""

from __future__ import annotations

_OFFLINE = (
    "LLM",
    "SamplingParams",
    "RequestHandle",
    "ResultQueue",
    "RequestStatus",
    "RequestOutput",
    "Output",
    "Conversation",
    "ParameterError",
    "EngineError",
)
__all__ = list(_OFFLINE)


def __getattr__(name: str):
    """Imported on first use, so the server and the proxy do not load the offline API (or torch) for nothing."""
    if name in _OFFLINE:
        from . import offline

        return getattr(offline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
