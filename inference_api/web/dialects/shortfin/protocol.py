"""shortfin request parsing: ``GenerateReqInput`` with its ``sampling_params`` (shapes: ``routes``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ....engine.messages import SamplingParams
from ....request.validation import boolean, number, only_default, reject_unknown, string, token_ids
from ....request_errors import RequestError

FIELDS = {
    "text",
    "input_ids",
    "image_data",
    "sampling_params",
    "rid",
    "return_input_ids",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
    "modalities",
    "is_single",
}
SAMPLING_FIELDS = {"n", "max_completion_tokens", "temperature", "top_k", "top_p", "num_beams"}
DEFAULT_MAX_COMPLETION_TOKENS = 50


@dataclass(frozen=True)
class ShortfinRequest:
    text: str | None
    input_ids: tuple[int, ...] | None
    params: SamplingParams  # max_tokens: sampling_params.max_completion_tokens
    rid: str
    return_input_ids: bool
    stream: bool


def parse_shortfin(body: dict, vocab_size: int) -> ShortfinRequest:
    reject_unknown(body, FIELDS)
    for name in ("image_data", "modalities"):
        only_default(body, name)
    only_default(body, "is_single", True)
    for name in ("return_logprob", "return_text_in_logprobs"):
        boolean(body, name, False)  # accepted, as shortfin accepts them; its answer carries no logprobs
    number(body, "logprob_start_len", -1, -1, 1 << 31, integer=True)
    number(body, "top_logprobs_num", 0, 0, 20, integer=True)
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise RequestError(
            "batched prompts are not supported: send one text or one list of input_ids per request",
            "text" if text is not None else "input_ids",
        )
    if (text is None) == (ids is None):
        raise RequestError("Either text or input_ids should be provided.", "text")
    sp = body.get("sampling_params")
    if isinstance(sp, list) and len(sp) == 1:
        sp = sp[0]
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise RequestError("sampling_params must be an object", "sampling_params")
    reject_unknown(sp, SAMPLING_FIELDS)
    only_default(sp, "n", 1)
    only_default(sp, "num_beams", 1)
    temperature = min(2.0, max(0.1, number(sp, "temperature", 1.0, 0, 100)))
    top_k = number(sp, "top_k", None, 1, 1_000_000, integer=True)
    top_p = number(sp, "top_p", None, 0, 1)
    sampling = top_k is not None or top_p is not None  # shortfin decodes greedily without top_k/top_p
    params = SamplingParams(
        temperature=temperature if sampling else 0.0,
        top_k=top_k or 0,
        top_p=min(0.99, max(0.01, top_p)) if top_p is not None else 1.0,
        max_tokens=number(sp, "max_completion_tokens", DEFAULT_MAX_COMPLETION_TOKENS, 1, 1 << 31, integer=True),
    )
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("rid must be a string", "rid")
    return ShortfinRequest(
        text=string(body, "text", required=True) if text is not None else None,
        input_ids=token_ids(body, "input_ids", vocab_size, required=True) if ids is not None else None,
        params=params,
        rid=rid or uuid.uuid4().hex,
        return_input_ids=boolean(body, "return_input_ids", False),
        stream=boolean(body, "stream", False),
    )
