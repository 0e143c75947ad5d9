"""The TGI-compatible API (text-generation-inference): /generate, /generate_stream, /, /info and /tokenize.

The text-generation client posts to the base URL itself (TGI's compat route ``/``), choosing by ``stream``.
Validation errors are 422 with ``error_type: "validation"``, as TGI sends them (``error_shapes``).
``/generate`` and ``/tokenize`` are shared with other dialects: ``routes_shared`` hands bodies with
``inputs`` here.
"""
from __future__ import annotations

from typing import Iterator

from flask import Blueprint, g, jsonify, request

from .error_shapes import TGI, error_body
from .generation import Generation
from .messages import FinishReason, TokenEvent, TokenLogprob
from .prepare import Prompt
from .serving import Serving
from .sse import sse, sse_response
from .tgi_schema import DEFAULT_MAX_NEW_TOKENS, TgiRequest, parse_tgi
from .validation import json_body, reject_unknown, string

FINISH = {FinishReason.EOS: "eos_token", FinishReason.STOP: "stop_sequence", FinishReason.LENGTH: "length"}


def tgi_blueprint(serving: Serving) -> Blueprint:
    tgi = Blueprint("tgi", __name__)

    @tgi.before_request
    def family() -> None:
        g.api = TGI

    @tgi.post("/")
    def compat_generate():
        return generate_tgi(serving, json_body(request), None)

    @tgi.post("/generate_stream")
    def generate_stream():
        return generate_tgi(serving, json_body(request), True)

    @tgi.get("/info")
    def info():
        config, ready = serving.config, serving.ready()
        return jsonify(model_id=ready.model_name, model_sha=None, model_dtype=ready.dtype,
                       model_device_type=ready.device, model_pipeline_tag="text-generation",
                       max_concurrent_requests=config.max_open_sessions, max_best_of=1,
                       max_stop_sequences=config.max_stop_sequences, max_input_tokens=ready.context_length - 1,
                       max_input_length=ready.context_length - 1, max_total_tokens=ready.context_length,
                       waiting_served_ratio=0.0, max_batch_total_tokens=config.rows * ready.context_length,
                       max_waiting_tokens=0, max_batch_size=config.rows, validation_workers=1,
                       max_client_batch_size=1, router="inference_api", version="0.1.0", sha=None, docker_label=None)

    return tgi


def generate_tgi(serving: Serving, body: dict, stream: bool | None):
    """TGI's /generate (stream False), /generate_stream (True) and / (None: the body's ``stream`` decides)."""
    g.api = TGI
    ready = serving.ready()
    req = parse_tgi(body, ready.context_length, serving.config.max_stop_sequences)
    prompt_ids = serving.tokenizer.encode(req.inputs)
    if req.truncate is not None:
        prompt_ids = prompt_ids[-req.truncate:]
    run = serving.start(Prompt(ids=prompt_ids), req.params, req.max_new_tokens, DEFAULT_MAX_NEW_TOKENS,
                        "max_new_tokens")
    if stream is True or (stream is None and req.stream):
        return sse_response(_stream(req, run.events()))
    answer = _response(req, run.collect())
    return jsonify([answer] if stream is None else answer)


def tokenize_tgi(serving: Serving, body: dict):
    """TGI's POST /tokenize: ``{"inputs"}`` into ``[{id, text, start, stop}]`` (character offsets)."""
    g.api = TGI
    reject_unknown(body, {"inputs", "parameters", "stream"})
    text = serving.tokenizable(string(body, "inputs", required=True), "inputs")
    return jsonify([{"id": t, "text": text[a:b], "start": a, "stop": b} for t, a, b in serving.tokenizer.offsets(text)])


def _token(token_id: int, text: str, logprob: float | None, special: bool) -> dict:
    return {"id": token_id, "text": text, "logprob": logprob, "special": special}


def _response(req: TgiRequest, gen: Generation) -> dict:
    text = (req.inputs if req.return_full_text else "") + gen.text
    if not req.details:
        return {"generated_text": text}
    last = len(gen.token_ids) - 1
    tokens = [_token(tid, lp.token, lp.logprob, i == last and gen.finish_reason is FinishReason.EOS)
              for i, (tid, lp) in enumerate(zip(gen.token_ids, gen.logprobs))]
    return {"generated_text": text,
            "details": {"finish_reason": FINISH.get(gen.finish_reason, "length"),
                        "generated_tokens": gen.completion_tokens, "seed": req.seed, "prefill": [],
                        "tokens": tokens}}


def _stream(req: TgiRequest, events: Iterator[TokenEvent]) -> Iterator[bytes]:
    """One SSE event per engine event (its text, its last token); the last one carries the full text."""
    parts = [req.inputs] if req.return_full_text else []
    for event in events:
        if event.finish_reason is FinishReason.ERROR:
            yield sse(error_body(TGI, 500, event.error or "generation failed"))
            return
        if event.finished and event.finish_reason not in FINISH:
            return  # cancelled: nobody is listening
        ids, lps, text = event.token_ids or (0,), event.logprobs, event.text
        eos = event.finish_reason is FinishReason.EOS
        if eos and text and len(ids) > 1:
            # text held back until the end token: send it on its own, as clients skip special tokens' text
            parts.append(text)
            yield sse(_stream_event(event.completion_tokens - 1, ids[-2], text, lps[-2] if len(lps) > 1 else None))
            text = ""
        parts.append(text)
        body = _stream_event(event.completion_tokens, ids[-1], text, lps[-1] if lps else None, special=eos)
        if event.finished:
            body["generated_text"] = "".join(parts)
            body["details"] = {"finish_reason": FINISH[event.finish_reason],
                               "generated_tokens": event.completion_tokens, "seed": req.seed}
        yield sse(body)


def _stream_event(index: int, token_id: int, text: str, lp: TokenLogprob | None, special: bool = False) -> dict:
    return {"index": index, "token": _token(token_id, text, lp.logprob if lp else None, special),
            "top_tokens": None, "generated_text": None, "details": None}
