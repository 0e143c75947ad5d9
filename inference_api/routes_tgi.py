"""The TGI-compatible API (text-generation-inference): /generate, /generate_stream, / and /info.

The text-generation client posts to the base URL itself (TGI's compat route ``/``), choosing by ``stream``.
Validation errors are 422 with ``error_type: "validation"``, as TGI sends them.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from flask import Blueprint, jsonify, request

from .app import engine_client, server_config
from .errors import ApiError, error_body, error_response
from .generation import Generation, all_events, collect
from .messages import FinishReason, TokenEvent, TokenLogprob
from .sse import sse, sse_response
from .streaming import first_event, session_events
from .tgi_schema import DEFAULT_MAX_NEW_TOKENS, MAX_STOP_SEQUENCES, TgiRequest, parse_tgi
from .validation import check_fits, json_body

tgi = Blueprint("tgi", __name__)

FINISH = {FinishReason.EOS: "eos_token", FinishReason.STOP: "stop_sequence", FinishReason.LENGTH: "length"}


@tgi.errorhandler(ApiError)
def tgi_error(err: ApiError):
    if err.status == 400:
        err.status = 422  # TGI's status for invalid input
    return error_response(err)


@tgi.post("/")
def compat_generate():
    req, first, events = _start()
    if req.stream:
        return sse_response(_stream(req, first, events))
    return jsonify([_response(req, collect(first, events))])


@tgi.post("/generate")
def generate():
    req, first, events = _start()
    return jsonify(_response(req, collect(first, events)))


@tgi.post("/generate_stream")
def generate_stream():
    req, first, events = _start()
    return sse_response(_stream(req, first, events))


@tgi.get("/info")
def info():
    client, config = engine_client(), server_config()
    ready = client.ready
    if ready is None:
        raise ApiError(503, "model is loading, try again shortly", retry_after=5)
    return jsonify(model_id=ready.model_name, model_sha=None, model_dtype=ready.dtype,
                   model_device_type=ready.device, model_pipeline_tag="text-generation",
                   max_concurrent_requests=config.max_open_sessions, max_best_of=1,
                   max_stop_sequences=MAX_STOP_SEQUENCES, max_input_tokens=ready.context_length - 1,
                   max_input_length=ready.context_length - 1, max_total_tokens=ready.context_length,
                   waiting_served_ratio=0.0, max_batch_total_tokens=config.rows * ready.context_length,
                   max_waiting_tokens=0, max_batch_size=config.rows, validation_workers=1, max_client_batch_size=1,
                   router="inference_api", version="0.1.0", sha=None, docker_label=None)


def _start() -> tuple[TgiRequest, TokenEvent | None, Iterator[TokenEvent]]:
    """Parse, tokenize, submit; wait for the first event (so early failures get a proper status)."""
    client = engine_client()
    if client.ready is None:
        raise ApiError(503, "model is loading, try again shortly", retry_after=5)
    context = client.ready.context_length
    req = parse_tgi(json_body(request), context)
    prompt_ids = client.tokenizer.encode(req.inputs)
    if req.truncate is not None:
        prompt_ids = prompt_ids[-req.truncate:]
    max_new = req.max_new_tokens or max(1, min(DEFAULT_MAX_NEW_TOKENS, context - len(prompt_ids)))
    check_fits(len(prompt_ids), max_new, context, "max_new_tokens")
    session = client.submit(prompt_ids, dataclasses.replace(req.params, max_tokens=max_new))
    events = session_events(client, session, request.environ)
    return req, first_event(events), events


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


def _stream(req: TgiRequest, first: TokenEvent | None, events: Iterator[TokenEvent]) -> Iterator[bytes]:
    """One SSE event per engine event (its text, its last token); the last one carries the full text."""
    parts = [req.inputs] if req.return_full_text else []
    for event in all_events(first, events):
        if event.finish_reason is FinishReason.ERROR:
            yield sse(error_body("/generate_stream", ApiError(500, event.error or "generation failed")))
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
