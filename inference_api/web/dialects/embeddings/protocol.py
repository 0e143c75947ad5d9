"""Embedding and rerank requests, transport-free (raising ``request_errors``): OpenAI's ``/v1/embeddings``
(``input`` a string, strings, token ids or lists of them; ``encoding_format`` float or base64; ``dimensions``),
TEI's ``/embed`` (``inputs``, ``normalize``, ``truncate``) and the two rerank shapes: Jina's and Cohere's, which
llama-server and vLLM serve on ``/rerank`` and ``/v1/rerank`` (``query``, ``documents``, ``top_n``,
``return_documents``), and TEI's on ``/rerank`` (``query``, ``texts``, ``raw_scores``, ``return_text``,
``truncate``)."""

from __future__ import annotations

from dataclasses import dataclass

from ....request.validation import boolean, number, reject_unknown, string
from ....request_errors import RequestError

MAX_INPUTS = 2048  # inputs of one request (OpenAI's limit)


@dataclass(frozen=True)
class EmbedInputs:
    texts: tuple[str, ...] | None  # texts to tokenize ...
    ids: tuple[tuple[int, ...], ...] | None  # ... or token ids as given
    normalize: bool = True
    truncate: bool = False  # cut inputs longer than the context (TEI's truncate) instead of refusing them
    base64: bool = False  # OpenAI's encoding_format base64
    dimensions: int | None = None  # OpenAI's: the vector's first N values (renormalized)
    model: str | None = None


def _texts(value, field: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value) and len(value) <= MAX_INPUTS:
        return tuple(value)
    raise RequestError(f"{field} must be a string or a non-empty list of at most {MAX_INPUTS} strings", field)


def parse_openai(body: dict, vocab_size: int) -> EmbedInputs:
    reject_unknown(body, {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"})
    value = body.get("input")
    texts: tuple[str, ...] | None = None
    ids: tuple[tuple[int, ...], ...] | None = None
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        ids = (tuple(value),)
    elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        if len(value) > MAX_INPUTS or not all(v and all(isinstance(t, int) for t in v) for v in value):
            raise RequestError("input must be token ids, or lists of token ids (non-empty)", "input")
        ids = tuple(tuple(v) for v in value)
    else:
        texts = _texts(value, "input")
    if ids is not None and any(not 0 <= t < vocab_size for row in ids for t in row):
        raise RequestError(f"input's token ids must be in [0, {vocab_size})", "input")
    if any(t == "" for t in texts or ()):
        raise RequestError("input must not contain empty strings", "input")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise RequestError("encoding_format must be float or base64", "encoding_format")
    return EmbedInputs(
        texts,
        ids,
        base64=fmt == "base64",
        dimensions=number(body, "dimensions", None, 1, 1 << 20, integer=True),
        model=string(body, "model", required=True),
    )


def parse_tei(body: dict) -> EmbedInputs:
    reject_unknown(body, {"inputs", "normalize", "truncate", "truncation_direction", "prompt_name", "dimensions"})
    if body.get("truncation_direction") not in (None, "Right", "right"):
        raise RequestError("truncation_direction: only Right is supported", "truncation_direction")
    return EmbedInputs(
        _texts(body.get("inputs"), "inputs"),
        None,
        normalize=boolean(body, "normalize", True),
        truncate=boolean(body, "truncate", False),
        dimensions=number(body, "dimensions", None, 1, 1 << 20, integer=True),
    )


@dataclass(frozen=True)
class Rerank:
    query: str
    documents: tuple[str, ...]
    top_n: int | None
    return_documents: bool
    tei: bool  # TEI's shape: a list of {index, score, text?}
    raw_scores: bool = False  # TEI's: the classifier's score itself, not its sigmoid
    truncate: bool = False
    model: str | None = None


def parse_rerank(body: dict) -> Rerank:
    """Jina's and Cohere's shape (``documents``: strings or {text}), or TEI's (``texts``)."""
    if "texts" in body:
        reject_unknown(body, {"query", "texts", "raw_scores", "return_text", "truncate", "truncation_direction"})
        return Rerank(
            string(body, "query", required=True),
            _texts(body.get("texts"), "texts"),
            None,
            boolean(body, "return_text", False),
            tei=True,
            raw_scores=boolean(body, "raw_scores", False),
            truncate=boolean(body, "truncate", False),
        )
    reject_unknown(body, {"model", "query", "documents", "top_n", "return_documents", "max_chunks_per_doc"})
    docs = body.get("documents")
    if isinstance(docs, list) and docs and all(isinstance(d, dict) and isinstance(d.get("text"), str) for d in docs):
        docs = [d["text"] for d in docs]
    return Rerank(
        string(body, "query", required=True),
        _texts(docs, "documents"),
        number(body, "top_n", None, 1, 1 << 20, integer=True),
        boolean(body, "return_documents", True),
        tei=False,
        model=string(body, "model"),
    )
