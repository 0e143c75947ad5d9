"""The TGI-compatible API (text-generation-inference): /generate, /generate_stream, /, /info and /tokenize.

The text-generation client posts to the base URL itself (TGI's compat route ``/``), choosing by ``stream``.
Validation errors are 422 with ``error_type: "validation"``, as TGI sends them (``error_shapes``).
``/generate`` and ``/tokenize`` are shared with other dialects: ``dialects.shared`` hands bodies with
``inputs`` here.
"""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from lifecycle.error_shapes import TGI

from ....request.prepare import Prompt
from ....request.validation import reject_unknown, string
from ...serving import Serving
from ..http import family_blueprint, json_body, sse_response
from .format import answer, stream
from .protocol import DEFAULT_MAX_NEW_TOKENS, parse_tgi


def tgi_blueprint(serving: Serving) -> Blueprint:
    tgi = family_blueprint("tgi", TGI)

    @tgi.post("/")
    def compat_generate():
        return generate_tgi(serving, json_body(request), None)

    @tgi.post("/generate_stream")
    def generate_stream():
        return generate_tgi(serving, json_body(request), True)

    @tgi.get("/info")
    def info():
        config, ready = serving.config, serving.ready()
        return jsonify(
            model_id=ready.model_name,
            model_sha=None,
            model_dtype=ready.dtype,
            model_device_type=ready.device,
            model_pipeline_tag="text-generation",
            max_concurrent_requests=config.max_open_sessions,
            max_best_of=1,
            max_stop_sequences=config.max_stop_sequences,
            max_input_tokens=ready.context_length - 1,
            max_input_length=ready.context_length - 1,
            max_total_tokens=ready.context_length,
            waiting_served_ratio=0.0,
            max_batch_total_tokens=config.rows * ready.context_length,
            max_waiting_tokens=0,
            max_batch_size=config.rows,
            validation_workers=1,
            max_client_batch_size=1,
            router="inference_api",
            version="0.1.0",
            sha=None,
            docker_label=None,
        )

    return tgi


def generate_tgi(serving: Serving, body: dict, streamed: bool | None):
    """TGI's /generate (streamed False), /generate_stream (True) and / (None: the body's ``stream`` decides)."""
    ready = serving.ready()
    req = parse_tgi(body, ready.context_length, serving.config.max_stop_sequences)
    prompt_ids = serving.tokenizer.encode(serving.tokenizable(req.inputs, "inputs"))
    if req.truncate is not None:
        prompt_ids = prompt_ids[-req.truncate :]
    run = serving.start(Prompt(ids=prompt_ids), req.params, DEFAULT_MAX_NEW_TOKENS, "max_new_tokens")
    if streamed is True or (streamed is None and req.stream):
        return sse_response(stream(req, run.events()))
    result = answer(req, run.collect())
    return jsonify([result] if streamed is None else result)


def tokenize_tgi(serving: Serving, body: dict):
    """TGI's POST /tokenize: ``{"inputs"}`` into ``[{id, text, start, stop}]`` (character offsets)."""
    reject_unknown(body, {"inputs", "parameters", "stream"})
    text = serving.tokenizable(string(body, "inputs", required=True), "inputs")
    return jsonify([{"id": t, "text": text[a:b], "start": a, "stop": b} for t, a, b in serving.tokenizer.offsets(text)])
