"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions, on the same engine."""
from __future__ import annotations

import dataclasses
import time

from flask import Blueprint, jsonify, request
from jinja2 import TemplateError

from .app import engine_client
from .errors import ApiError
from .generation import all_events, collect
from .openai_responses import ChatFormat, CompletionFormat, stream_chunks
from .openai_schema import OpenAIRequest, parse_chat, parse_completion
from .routes_native import served_model
from .sse import sse_response
from .streaming import first_event, session_events
from .validation import check_fits, json_body, string

openai_api = Blueprint("openai", __name__)

# max_tokens when the request has none: as many as fit in the context, at most this many
DEFAULT_MAX_TOKENS = 1024


def _check_model(body: dict) -> None:
    try:
        served_model(string(body, "model", required=True))
    except ApiError as err:
        if err.status == 404:
            err.code = "model_not_found"
        raise


@openai_api.get("/v1/models")
def models():
    if engine_client().ready is None:
        raise ApiError(503, "model is loading, try again shortly", retry_after=5)
    return jsonify(object="list", data=[_model_object()])


@openai_api.get("/v1/models/<path:model_name>")
def model(model_name: str):
    _check_model({"model": model_name})
    return jsonify(_model_object())


def _model_object() -> dict:
    return {"id": engine_client().ready.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "inference_api"}


@openai_api.post("/v1/completions")
def completions():
    body = json_body(request)
    _check_model(body)
    client = engine_client()
    req = parse_completion(body, client.ready.vocab_size)
    prompt_ids = list(req.prompt_ids) if req.prompt_ids else client.tokenizer.encode(req.prompt)
    return _generate(req, prompt_ids, CompletionFormat(client.ready, req.params.logprobs is not None))


@openai_api.post("/v1/chat/completions")
def chat_completions():
    body = json_body(request)
    _check_model(body)
    client = engine_client()
    req = parse_chat(body)
    try:
        prompt_ids = client.tokenizer.encode_chat(list(req.messages))
    except TemplateError as err:  # e.g. a template that insists on alternating user/assistant turns
        raise ApiError(400, f"messages do not fit the model's chat template: {err}", param="messages") from None
    return _generate(req, prompt_ids, ChatFormat(client.ready, req.params.logprobs is not None))


def _generate(req: OpenAIRequest, prompt_ids: list[int], fmt):
    client = engine_client()
    context = client.ready.context_length
    max_tokens = req.max_tokens or max(1, min(DEFAULT_MAX_TOKENS, context - len(prompt_ids)))
    check_fits(len(prompt_ids), max_tokens, context, req.max_tokens_field)
    session = client.submit(prompt_ids, dataclasses.replace(req.params, max_tokens=max_tokens))
    events = session_events(client, session, request.environ)
    first = first_event(events)
    if not req.stream:
        return jsonify(fmt.response(collect(first, events), len(prompt_ids)))
    return sse_response(stream_chunks(fmt, all_events(first, events), len(prompt_ids), req.include_usage))
