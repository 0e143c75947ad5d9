"""The Python API for offline and embedded use (docs/offline.md): ``LLM`` and its ``SamplingParams`` (llm.py), the
handles and results it gives (results.py), and ``python -m inference_api.offline.generate`` for a file of prompts."""

from .llm import LLM, Conversation, EngineError, ParameterError, SamplingParams
from .results import Output, RequestHandle, RequestOutput, RequestStatus, ResultQueue

__all__ = [
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
]
