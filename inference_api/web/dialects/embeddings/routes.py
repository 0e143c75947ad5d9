"""The embedding and rerank routes: OpenAI's ``/v1/embeddings``, TEI's ``/embed``, and ``/rerank`` and
``/v1/rerank`` (Jina's and Cohere's shape, or TEI's when the body has ``texts``), over the one ``Serving``."""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from lifecycle.error_shapes import OPENAI, TGI

from ...errors import answer_as
from ...serving import Serving
from ..http import family_blueprint, json_body, numbers_response
from .format import openai_embeddings, rerank_body, vector
from .protocol import parse_openai, parse_rerank, parse_tei


def embeddings_blueprint(serving: Serving) -> Blueprint:
    api = family_blueprint("embeddings", OPENAI)

    @api.post("/v1/embeddings")
    def openai_route():
        inputs = parse_openai(json_body(request), serving.ready().vocab_size)
        serving.check_model(inputs.model or "", placeholders=True)
        vectors, tokens = serving.embed(inputs.texts, inputs.ids, inputs.normalize, inputs.truncate, "input")
        return numbers_response(openai_embeddings(vectors, inputs, serving.model_name, tokens))

    @api.post("/embed")
    def tei_route():
        answer_as(TGI)  # TEI's errors: {error, error_type}, 413/422 for bad input
        inputs = parse_tei(json_body(request))
        vectors, _ = serving.embed(inputs.texts, None, inputs.normalize, inputs.truncate, "inputs")
        return numbers_response([vector(v, inputs) for v in vectors])

    @api.post("/rerank")
    @api.post("/v1/rerank")
    def rerank_route():
        body = json_body(request)
        if "texts" in body:
            answer_as(TGI)
        req = parse_rerank(body)
        if req.model is not None:
            serving.check_model(req.model, placeholders=True)
        scores, tokens = serving.score(req.query, list(req.documents), req.truncate)
        return jsonify(rerank_body(scores, req, serving.model_name, tokens))

    return api
