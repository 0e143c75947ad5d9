"""Paths two dialects share, told apart by the body: ``/generate`` (TGI sends ``inputs``; shortfin ``text`` or
``input_ids``) and ``/tokenize`` (TGI sends ``inputs``; vLLM ``prompt`` or ``messages``)."""
from __future__ import annotations

from flask import Blueprint, g, request

from .error_shapes import OPENAI, SHORTFIN, api_of
from .routes_openai import detokenize_openai, tokenize_openai
from .routes_tgi import generate_tgi, tokenize_tgi
from .serving import Serving
from .shortfin import generate_shortfin
from .validation import json_body


def shared_blueprint(serving: Serving) -> Blueprint:
    bp = Blueprint("shared", __name__)

    @bp.before_request
    def family() -> None:
        g.api = api_of(request.path)  # until the body is read: TGI's shape, as before these paths were shared

    @bp.route("/generate", methods=["POST", "PUT"])  # shortfin answers PUT too
    def generate():
        body = json_body(request)
        if api_of("/generate", body) == SHORTFIN:
            return generate_shortfin(serving, body)
        return generate_tgi(serving, body, False)

    @bp.post("/tokenize")
    def tokenize():
        body = json_body(request)
        if api_of("/tokenize", body) == OPENAI:
            return tokenize_openai(serving, body)
        return tokenize_tgi(serving, body)

    @bp.post("/detokenize")
    def detokenize():
        return detokenize_openai(serving, json_body(request))

    return bp
