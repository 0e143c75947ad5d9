"""llama-stack's inference API as it was when the boilerplate seed served it (llama-stack 0.0.x,
llama-stack-client up to 0.0.50): POST /inference/completion and /inference/chat_completion.

Shapes from llama-stack's ``apis/inference`` and ``llama_models`` datatypes of that time:
``SamplingParams`` (``strategy`` greedy | top_p | top_k, default greedy; ``temperature`` 0.0, ``top_p`` 0.95,
``top_k`` 0, ``max_tokens`` 0 (as many as fit), ``repetition_penalty`` 1.0), ``logprobs: {"top_k"}``;
answers ``CompletionResponse`` ``{content, stop_reason, logprobs}``, ``ChatCompletionResponse``
``{completion_message: {role, content, stop_reason, tool_calls}, logprobs}``, stream chunks
``{delta, stop_reason, logprobs}`` and ``{event: {event_type, delta, stop_reason, logprobs}}``.
Streams are server-sent events when the client accepts ``text/event-stream`` (llama-stack-client does),
otherwise one JSON object per line (what the boilerplate sent, for ``requests``' ``iter_lines()``).
Errors are ``{"detail": message}``, FastAPI's shape.
"""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from lifecycle.error_shapes import LLAMA_STACK

from ....request.prepare import Prompt
from ...serving import Serving
from ...sse import sse
from ..http import family_blueprint, json_body, sse_response
from .format import answer, ndjson, stream
from .protocol import LlamaStackRequest, parse_chat, parse_completion


def llama_stack_blueprint(serving: Serving) -> Blueprint:
    bp = family_blueprint("llama_stack", LLAMA_STACK)

    @bp.post("/inference/completion")
    def completion():
        req = parse_completion(json_body(request), serving.check_model)
        return respond(req, Prompt(text=req.content), chat=False)

    @bp.post("/inference/chat_completion")
    def chat_completion():
        req = parse_chat(json_body(request), serving.check_model)
        tools = req.tools.tools if req.tools is not None else None
        return respond(req, Prompt(messages=req.messages, tools=tools), chat=True)

    def respond(req: LlamaStackRequest, prompt: Prompt, chat: bool):
        run = serving.start(prompt, req.params, field="sampling_params.max_tokens")
        want = req.params.logprobs is not None
        if not req.stream:
            return jsonify(answer(run.collect(), chat, want, req.tools))
        event_stream = "text/event-stream" in request.headers.get("Accept", "")
        frame = sse if event_stream else ndjson
        chunks = stream(run.events(), chat, want, req.tools)
        return sse_response((frame(c) for c in chunks), "text/event-stream" if event_stream else "application/x-ndjson")

    return bp
