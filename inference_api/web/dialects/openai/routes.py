"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions, and vLLM's /tokenize and
/detokenize (a /tokenize body with ``inputs`` is TGI's: ``dialects.shared`` tells them apart)."""

from __future__ import annotations

import time

from flask import Blueprint, Response, jsonify, request

from lifecycle.error_shapes import OPENAI

from ....engine.messages import EngineReady
from ....request.prepare import Prompt
from ....request.validation import reject_unknown, string
from ....request_errors import NotFound, RequestError
from ...models import ModelSlot
from ...serving import Run, Serving
from ..http import family_blueprint, json_body, sse_response
from .format import ChatFormat, CompletionFormat, response_body, stream_chunks
from .protocol import OpenAIRequest, parse_chat, parse_completion, parse_detokenize, parse_tokenize
from .tool_format import ToolChatFormat


def openai_blueprint(serving: Serving) -> Blueprint:
    api = family_blueprint("openai", OPENAI)
    max_stop = serving.config.max_stop_sequences

    def model_object(slot: ModelSlot) -> dict:
        """A model's card: OpenAI's fields, vLLM's max_model_len, and llama-server's status (loaded or not, with
        its memory)."""
        ready = slot.client.ready if slot.client is not None else None
        if slot.default:
            ready = serving.ready()  # (the first model: a 503 while it loads, as before several models)
        return {
            "id": ready.model_name if slot.default and ready else slot.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "inference_api",
            "max_model_len": ready.context_length if ready else slot.config.context_length,
            "status": slot.describe(),
        }

    def adapter_objects(slot: ModelSlot) -> list[dict]:
        """The LoRA adapters of a loaded model, each a model name of its own (as vLLM lists them), with its
        base as parent; ``base:name`` names it too."""
        client = slot.client
        if client is None or client.ready is None:
            return []
        return [
            {
                "id": a.name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "inference_api",
                "parent": slot.name if not slot.default else client.ready.model_name,
                "max_model_len": client.ready.context_length,
                "status": {"value": "loaded", "lora": {"rank": a.rank, "alpha": a.alpha, "bytes": a.bytes}},
            }
            for a in client.adapters
        ]

    @api.get("/v1/models")
    def models():
        slots = serving.models.slots()
        return jsonify(
            object="list", data=[model_object(s) for s in slots] + [a for s in slots for a in adapter_objects(s)]
        )

    @api.get("/v1/models/<path:model_name>")
    def model(model_name: str):
        return jsonify(model_object(serving.models.slot(model_name)))  # (named, not loaded)

    def parsed(parse) -> tuple[OpenAIRequest, EngineReady]:
        """The body, its model checked, through ``parse``."""
        body = json_body(request)
        serving.check_model(string(body, "model", required=True), placeholders=True)  # "tgi", "dummy" too
        ready = serving.ready()
        return parse(body, ready.vocab_size, max_stop), ready

    @api.post("/v1/completions")
    def completions():
        req, ready = parsed(parse_completion)
        prompt = Prompt(text=req.prompt, ids=req.prompt_ids)
        return respond(req, prompt, CompletionFormat(ready, req.params.logprobs is not None))

    @api.post("/v1/chat/completions")
    def chat_completions():
        req, ready = parsed(parse_chat)
        want_logprobs = req.params.logprobs is not None
        prompt = Prompt.chat(req.messages or (), req.tools)
        if prompt.tools is not None and req.tools is not None:
            return respond(req, prompt, ToolChatFormat(ready, want_logprobs, req.tools))
        return respond(req, prompt, ChatFormat(ready, want_logprobs))

    def respond(req: OpenAIRequest, prompt: Prompt, fmt):
        run: Run = serving.start(prompt, req.params, field=req.max_tokens_field, thinking=req.thinking, lora=req.lora)
        fmt.model = serving.model_name  # (an adapter's name as the request gave it)
        if req.echo or req.prompt_logprobs is not None:  # the prompt's log-probs came with the first event
            text = req.prompt if req.prompt is not None else serving.tokenizer.decode(list(run.prompt_ids))
            fmt.scoring(
                text if req.echo else None,
                serving.tokenizer.decode(list(run.prompt_ids[:1])),
                run.first.prompt_logprobs if run.first is not None else None,
                req.params.logprobs,
                req.prompt_logprobs,
            )
        if not req.stream:
            return jsonify(response_body(fmt, run.collect_choices(), run.prompt_tokens))
        return sse_response(
            stream_chunks(fmt, run.events(), run.prompt_tokens, req.include_usage, req.continuous_usage, run.n)
        )

    @api.post("/v1/load_lora_adapter")
    def load_lora_adapter():
        """vLLM's runtime load (``lora_name``, ``lora_path``; this server's ``model``: which model's, the first's
        when absent); the proxy lets operators alone."""
        body = json_body(request)
        reject_unknown(body, {"lora_name", "lora_path", "model"})
        name, path = string(body, "lora_name", required=True), string(body, "lora_path", required=True)
        client = adapter_engine(body)
        try:
            client.load_adapter(name, path)
        except ValueError as exc:
            raise RequestError(str(exc), "lora_path") from None
        return Response(f"Success: LoRA adapter '{name}' added successfully.", content_type="text/plain")

    @api.post("/v1/unload_lora_adapter")
    def unload_lora_adapter():
        """vLLM's runtime unload (``lora_name``): refused to new requests at once, freed after its last; the proxy
        lets operators alone."""
        body = json_body(request)
        reject_unknown(body, {"lora_name", "lora_int_id", "model"})
        name = string(body, "lora_name", required=True)
        client = adapter_engine(body)
        try:
            unloaded = client.unload_adapter(name)
        except ValueError as exc:
            raise RequestError(str(exc), "lora_name") from None
        if not unloaded:
            raise NotFound(f"no LoRA adapter {name!r} is loaded", "lora_name")
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", content_type="text/plain")

    def adapter_engine(body: dict):
        slot = serving.models.slot(string(body, "model") or serving.models.default.name)
        client = serving.models.acquire(slot)
        client.check_ready()
        return client

    @api.post("/detokenize")
    def detokenize():
        """vLLM's POST /detokenize: ``tokens`` into ``{prompt}``."""
        body = json_body(request)
        model = string(body, "model")
        if model is not None:
            serving.check_model(model)
        tokens = parse_detokenize(body, serving.ready().vocab_size)
        return jsonify(prompt=serving.tokenizer.decode(list(tokens)))

    return api


def tokenize_openai(serving: Serving, body: dict):
    """vLLM's POST /tokenize: ``prompt`` or ``messages`` into ``{count, max_model_len, tokens}``."""
    model = string(body, "model")
    if model is not None:
        serving.check_model(model)
    req = parse_tokenize(body)
    if req.messages is not None:
        ids = serving.encode(Prompt(messages=req.messages, tools=req.tools))
    elif req.prompt is None:  # (parse_tokenize requires one of them)
        raise RequestError("prompt or messages is required", "prompt")
    else:
        ids = serving.tokenizer.encode(
            serving.tokenizable(req.prompt, "prompt"), add_special_tokens=req.add_special_tokens
        )
    out = {"count": len(ids), "max_model_len": serving.ready().context_length, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [serving.tokenizer.decode([t]) for t in ids]
    return jsonify(out)
