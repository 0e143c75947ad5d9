"""Anthropic's Messages API: ``POST /v1/messages`` (streamed or whole) and ``POST /v1/messages/count_tokens``, over
the one ``Serving``, its errors in Anthropic's shape (``{"type": "error", "error": {type, message}}``)."""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from lifecycle.error_shapes import ANTHROPIC

from ....request.prepare import Prompt
from ...serving import Serving
from ..http import family_blueprint, json_body, sse_response
from .format import MessageFormat, stream_events
from .protocol import parse_count_tokens, parse_messages_request


def anthropic_blueprint(serving: Serving) -> Blueprint:
    api = family_blueprint("anthropic", ANTHROPIC)
    max_stop = serving.config.max_stop_sequences

    @api.post("/v1/messages")
    def messages():
        req = parse_messages_request(json_body(request), max_stop)
        serving.check_model(req.model, placeholders=True)
        prompt = Prompt.chat(req.messages, req.tools)
        fmt = MessageFormat(serving.model_name, req.tools, req.stop_sequences)
        run = serving.start(prompt, req.params, thinking=req.thinking)
        if req.stream:
            return sse_response(stream_events(fmt, run.events(), run.prompt_tokens))
        return jsonify(fmt.response(run.collect(), run.prompt_tokens))

    @api.post("/v1/messages/count_tokens")
    def count_tokens():
        model, msgs, tools = parse_count_tokens(json_body(request))
        serving.check_model(model, placeholders=True)
        ids = serving.encode(Prompt.chat(msgs, tools))
        return jsonify(input_tokens=len(ids))

    return api
