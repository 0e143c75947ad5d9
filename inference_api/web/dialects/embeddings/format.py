"""Embedding and rerank answers in each API's shape."""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence

import numpy as np

from .protocol import EmbedInputs, Rerank


def vector(values: np.ndarray, inputs: EmbedInputs) -> np.ndarray | str:
    """A vector as asked: its first ``dimensions`` values (L2-normalized again when the request normalizes), as
    float32 (``numbers_response`` writes each in its shortest form) or little-endian float32 base64."""
    array = np.asarray(values, dtype=np.float32)
    if inputs.dimensions is not None:
        array = array[: inputs.dimensions]
        if inputs.normalize:
            array = array / (np.linalg.norm(array) or np.float32(1.0))
    if inputs.base64:
        return base64.b64encode(array.astype("<f4").tobytes()).decode()
    return array


def openai_embeddings(vectors: Sequence[np.ndarray], inputs: EmbedInputs, model: str, tokens: int) -> dict:
    data = [{"object": "embedding", "index": i, "embedding": vector(v, inputs)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def relevance(score: float) -> float:
    """A cross-encoder's score as a relevance in (0, 1) (its sigmoid, as TEI and Jina report it)."""
    return 1.0 / (1.0 + math.exp(-score))


def rerank_body(scores: list[float], req: Rerank, model: str, tokens: int):
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n is not None:
        order = order[: req.top_n]
    if req.tei:
        return [
            {
                "index": i,
                "score": scores[i] if req.raw_scores else relevance(scores[i]),
                **({"text": req.documents[i]} if req.return_documents else {}),
            }
            for i in order
        ]
    results = [
        {
            "index": i,
            "relevance_score": relevance(scores[i]),
            **({"document": {"text": req.documents[i]}} if req.return_documents else {}),
        }
        for i in order
    ]
    return {
        "model": model,
        "object": "list",
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
