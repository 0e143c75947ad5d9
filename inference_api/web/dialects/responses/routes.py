"""OpenAI's Responses API: ``POST /v1/responses`` (streamed or whole), ``GET`` and ``DELETE /v1/responses/{id}``,
over the one ``Serving``, errors in OpenAI's shape. A stored response (``store``, the default) is its team's
(the proxy's ``X-Team-Id``): ``previous_response_id``, ``GET`` and ``DELETE`` of another team's id are 404."""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from lifecycle.error_shapes import OPENAI

from ....request.prepare import Prompt
from ....request_errors import NotFound
from ...serving import Serving
from ..http import family_blueprint, json_body, sse_response
from ..openai.protocol import parse_messages
from .format import ResponseFormat, output_messages
from .protocol import parse_responses
from .store import ResponseStore


def responses_blueprint(serving: Serving) -> Blueprint:
    api = family_blueprint("responses", OPENAI)
    config = serving.config
    store = ResponseStore(config.responses_store_max, config.responses_store_seconds)

    def team() -> str | None:
        return request.headers.get("X-Team-Id")

    def stored(response_id: str, field: str | None = None):
        found = store.get(team(), response_id)
        if found is None:
            raise NotFound(f"Response with id {response_id!r} not found.", field)
        return found

    @api.post("/v1/responses")
    def create():
        req = parse_responses(json_body(request), config.max_stop_sequences)
        serving.check_model(req.model, placeholders=True)
        history: tuple[dict, ...] = ()
        if req.previous_response_id is not None:
            history = stored(req.previous_response_id, "previous_response_id").conversation
        system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        turn = req.input_messages
        prompt = Prompt.chat(parse_messages([*system, *history, *turn]), req.tools)
        fmt = ResponseFormat(serving.model_name, req.echo, req.tools, req.previous_response_id, req.store)
        run = serving.start(prompt, req.params, field="max_output_tokens", thinking=req.thinking)
        owner = team()

        def keep(response: dict) -> None:
            if req.store:
                store.put(owner, response, (*history, *turn, *output_messages(response["output"])))

        if req.stream:
            return sse_response(fmt.stream(run.events(), run.prompt_tokens, keep))
        body = fmt.response(run.collect(), run.prompt_tokens)
        keep(body)
        return jsonify(body)

    @api.get("/v1/responses/<response_id>")
    def retrieve(response_id: str):
        return jsonify(stored(response_id).response)

    @api.delete("/v1/responses/<response_id>")
    def delete(response_id: str):
        if not store.delete(team(), response_id):
            raise NotFound(f"Response with id {response_id!r} not found.")
        return jsonify(id=response_id, object="response", deleted=True)

    return api
