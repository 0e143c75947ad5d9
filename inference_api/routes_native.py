"""The native API, compatible with the original inference API: /inference, /predictions, /health, /metrics."""
from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify, request, stream_with_context

from lifecycle.drain import RETRY_AFTER

from .app import engine_client, server_config
from .errors import ApiError
from .generation import all_events, collect
from .metrics import CONTENT_TYPE
from .streaming import first_event, session_events
from .validation import check_fits, json_body, parse_native

native = Blueprint("native", __name__)


def served_model(model_name: str) -> None:
    client = engine_client()
    if client.ready is None:
        raise ApiError(503, "model is loading, try again shortly", retry_after=5)
    if model_name != client.ready.model_name:
        raise ApiError(404, f"unknown model {model_name!r}; this server serves {client.ready.model_name!r}")


@native.post("/inference/<model_name>")
def inference(model_name: str):
    return _generate(model_name, chat=False)


@native.post("/predictions/<model_name>")
def predictions(model_name: str):
    return _generate(model_name, chat=True)


def _generate(model_name: str, chat: bool):
    served_model(model_name)
    req = parse_native(json_body(request))
    client = engine_client()
    tokenizer = client.tokenizer
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": req.text}]) if chat else tokenizer.encode(req.text)
    check_fits(len(prompt_ids), req.params.max_tokens, client.ready.context_length)
    session = client.submit(prompt_ids, req.params)
    events = session_events(client, session, request.environ)
    first = first_event(events)
    prefix = req.text if req.return_prompt else ""

    if not req.stream:
        gen = collect(first, events)
        return jsonify(text=prefix + gen.text, finish_reason=gen.finish_reason.value if gen.finish_reason else None,
                       prompt_tokens=session.prompt_tokens, completion_tokens=gen.completion_tokens)

    def body():
        if prefix:
            yield prefix.encode()
        for event in all_events(first, events):
            if event.error:
                raise RuntimeError(event.error)  # cut the chunked stream: the client sees an incomplete response
            if event.text:
                yield event.text.encode()

    return Response(stream_with_context(body()), mimetype="text/plain", content_type="text/plain; charset=utf-8",
                    headers={"X-Accel-Buffering": "no", "Cache-Control": "no-cache"})


@native.get("/health")
def health():
    """200 only while serving; 503 while loading, restarting the engine, draining or failed."""
    client = engine_client()
    ready = client.ready
    state = "draining" if current_app.extensions["drain"].active else client.state
    estimate = current_app.extensions["preflight"]
    body = {"status": state, "model": ready.model_name if ready else None,
            "rows_in_use": client.stats.rows_in_use, "rows_total": server_config().rows,
            "queue_length": client.stats.waiting, "open_sessions": client.open_sessions,
            "mock": server_config().mock, "model_dir": ready.model_dir if ready else None,
            "device": ready.device if ready else None, "dtype": ready.dtype if ready else None,
            "quantize": ready.quantize if ready else None, "kv_dtype": ready.kv_dtype if ready else None,
            "context_length": ready.context_length if ready else None, "backend_pid": client.process.pid,
            "engine_restarts": client.restart_count,
            "memory": estimate.as_dict() if estimate else None}
    if client.failure is not None:
        body["message"] = client.failure
    response = jsonify(body)
    response.status_code = 200 if state == "ready" else 503
    if state != "ready":
        response.headers["Retry-After"] = str(RETRY_AFTER)
    return response


@native.get("/metrics")
def metrics():
    """Prometheus text format: requests, tokens, latency histograms, rows and queue."""
    return Response(engine_client().metrics.exposition(), content_type=CONTENT_TYPE)
