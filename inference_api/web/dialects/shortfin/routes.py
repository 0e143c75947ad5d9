"""shortfin's LLM server dialect (``shortfin_apps.llm``): POST /generate with ``text`` or ``input_ids``.

Request and answer follow shortfin's own structs (``components/io_struct.py``): ``GenerateReqInput`` with
``sampling_params`` (``SamplingParams``: ``n``, ``max_completion_tokens`` (50), ``temperature`` (1.0, clamped to
[0.1, 2.0]), ``top_k``, ``top_p`` (clamped to [0.01, 0.99]), ``num_beams``). As in shortfin, decoding is
greedy unless ``top_k`` or ``top_p`` is given. The answer is ``GenerateReqOutput``:
``{"responses": [{"prompt": text, "responses": [{"text": ...}]}]}``, or the generated token ids when
``return_input_ids`` is true; a stream is ``data(<rid>): <text>`` events ending with ``data: [DONE]``.
Errors are ``{"error": message, "code": "INVALID_REQUEST_ARGS" | "QUEUE_FULL" | ...}``.
"""

from __future__ import annotations

from flask import jsonify

from ....request.prepare import Prompt
from ...serving import Serving
from ..http import sse_response
from .format import answer, stream
from .protocol import parse_shortfin


def generate_shortfin(serving: Serving, body: dict):
    req = parse_shortfin(body, serving.ready().vocab_size)
    run = serving.start(Prompt(text=req.text, ids=req.input_ids), req.params, field="max_completion_tokens")
    if req.stream:
        return sse_response(stream(req, run.events()))
    return jsonify(answer(req, run.collect()))
