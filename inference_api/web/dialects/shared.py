"""Paths two dialects share, told apart by the body: ``/generate`` (TGI sends ``inputs``; shortfin ``text`` or
``input_ids``) and ``/tokenize`` (TGI sends ``inputs``; vLLM ``prompt`` or ``messages``). Until the body is
read, errors have the path's family (TGI's, as before these paths were shared); then the body's."""

from __future__ import annotations

from flask import Blueprint, request

from lifecycle.error_shapes import OPENAI, SHORTFIN, api_of

from ..errors import answer_as
from ..serving import Serving
from .http import json_body
from .openai.routes import tokenize_openai
from .shortfin.routes import generate_shortfin
from .tgi.routes import generate_tgi, tokenize_tgi


def shared_blueprint(serving: Serving) -> Blueprint:
    bp = Blueprint("shared", __name__)

    def body_and_family() -> tuple[dict, str]:
        """The JSON body, and the family it shows, which the request answers in from here on."""
        body = json_body(request)
        api = api_of(request.path, body)
        answer_as(api)
        return body, api

    @bp.route("/generate", methods=["POST", "PUT"])  # shortfin answers PUT too
    def generate():
        body, api = body_and_family()
        if api == SHORTFIN:
            return generate_shortfin(serving, body)
        return generate_tgi(serving, body, False)

    @bp.post("/tokenize")
    def tokenize():
        body, api = body_and_family()
        if api == OPENAI:
            return tokenize_openai(serving, body)
        return tokenize_tgi(serving, body)

    return bp
