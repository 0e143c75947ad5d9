"""The native API, compatible with the original inference API: /inference, /predictions, /health, /metrics.

Model names may contain ``/`` (hub ids such as ``org/name``): the routes take the rest of the path.
"""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request

from lifecycle.drain import RETRY_AFTER
from lifecycle.error_shapes import NATIVE, OTHER

from ....engine.metrics import CONTENT_TYPE, exposition_of
from ....request.prepare import Prompt
from ....request.validation import string
from ....request_errors import Conflict
from ...serving import Serving
from ..http import family_blueprint, json_body, sse_response
from .format import answer, text_stream
from .protocol import parse_native


def native_blueprint(serving: Serving) -> Blueprint:
    native = family_blueprint("native", NATIVE)
    config = serving.config

    @native.post("/inference/<path:model_name>")
    def inference(model_name: str):
        return generate(model_name, chat=False)

    @native.post("/predictions/<path:model_name>")
    def predictions(model_name: str):
        return generate(model_name, chat=True)

    def generate(model_name: str, chat: bool):
        serving.check_model(model_name)
        req = parse_native(json_body(request), config.max_stop_sequences)
        prompt = (
            Prompt(messages=[{"role": "user", "content": req.text}], field="text") if chat else Prompt(text=req.text)
        )
        run = serving.start(prompt, req.params)
        prefix = req.text if req.return_prompt else ""
        if not req.stream:
            return jsonify(answer(prefix, run.collect(), run.prompt_tokens))
        return sse_response(text_stream(prefix, run.events()), "text/plain")

    return native


def health_blueprint(serving: Serving) -> Blueprint:
    """/health and /metrics, which serve every dialect and belong to no API family."""
    server = family_blueprint("health", OTHER)
    config = serving.config

    @server.get("/health")
    def health():
        """200 only while serving; 503 while loading, restarting the engine, draining or failed."""
        client = serving.client
        ready, process = client.ready, client.process
        state = "draining" if serving.draining else client.state
        estimate = serving.preflight
        body = {
            "status": state,
            "model": ready.model_name if ready else None,
            "rows_in_use": client.stats.rows_in_use,
            "rows_total": config.rows,
            "queue_length": client.stats.waiting,
            "open_sessions": client.open_sessions,
            "mock": config.mock,
            "model_dir": ready.model_dir if ready else None,
            "device": ready.device if ready else None,
            "dtype": ready.dtype if ready else None,
            "context_length": ready.context_length if ready else None,
            "quantize": ready.quantize if ready else None,
            "kv_dtype": ready.kv_dtype if ready else None,
            "matmul_dtype": ready.matmul_dtype if ready else None,
            "int8_inputs": ready.int8_inputs if ready else None,
            "kernels": ready.kernels if ready else None,
            "cuda_graphs": list(ready.cuda_graphs) if ready else None,
            "backend_pid": process.pid if process else None,
            "tensor_parallel_size": config.tensor_parallel_size,
            "ranks": [
                {"rank": i, "pid": pid, "alive": alive}
                for i, (pid, alive) in enumerate(
                    zip((process.pid if process else None, *ready.rank_pids), client.ranks_alive())
                )
            ]
            if ready
            else [],
            "engine_restarts": client.restart_count,
            "memory": estimate.as_dict() if estimate else None,
        }
        if client.failure is not None:
            body["message"] = client.failure
        if serving.models.several:
            body["models"] = {slot.name: slot.describe() for slot in serving.models.slots()}
        response = jsonify(body)
        response.status_code = 200 if state == "ready" else 503
        if state != "ready":
            response.headers["Retry-After"] = str(RETRY_AFTER)
        return response

    @server.get("/metrics")
    def metrics():
        """Prometheus text format: requests, tokens, latency histograms, rows and queue (with several models,
        each sample labelled with its model)."""
        models = [(s.name, s.client.metrics) for s in serving.models.slots() if s.client is not None]
        return Response(exposition_of(models), content_type=CONTENT_TYPE)

    @server.get("/lora-adapters")
    def lora_adapters():
        """llama-server's list of a model's LoRA adapters (the first model's, or ``?model=``): each one's id (its
        place, which a request's ``lora`` list may name), name, path and scale; the proxy lets operators alone."""
        slot = serving.models.slot(request.args.get("model") or serving.models.default.name)
        client = serving.models.acquire(slot)
        client.check_ready()
        return jsonify([{"id": i, "name": a.name, "path": a.path, "scale": 1.0} for i, a in enumerate(client.adapters)])

    @server.post("/models/load")
    def load_model():
        """llama-server's router: load a model now (``{"model": name}``); the proxy lets operators alone."""
        slot = serving.models.slot(string(json_body(request), "model", required=True))
        serving.models.acquire(slot).check_ready()
        return jsonify(success=True, model=slot.name, status=slot.describe())

    @server.post("/models/unload")
    def unload_model():
        """Unload a model (not the first; not one with open requests: 409); the proxy lets operators alone."""
        slot = serving.models.slot(string(json_body(request), "model", required=True))
        if slot.client is not None and not serving.models.unload(slot.name):
            why = "the first model stays loaded" if slot.default else "it has open requests"
            raise Conflict(f"model {slot.name!r} was not unloaded: {why}", "model")
        return jsonify(success=True, model=slot.name, status=slot.describe())

    return server
