"""TGI request parsing: the ``{"inputs", "parameters", "stream"}`` body the text-generation client sends."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ....config import DEFAULT_MAX_STOP_SEQUENCES
from ....engine.grammar import Grammar, json_schema, maybe_json, text_grammar
from ....engine.messages import SamplingParams
from ....request.validation import boolean, number, only_default, reject_unknown, stop_list, string
from ....request_errors import RequestError

TGI_FIELDS = {"inputs", "parameters", "stream"}
# every field text-generation 0.7's Parameters model serialises
TGI_PARAMETERS = {
    "do_sample",
    "max_new_tokens",
    "repetition_penalty",
    "frequency_penalty",
    "return_full_text",
    "stop",
    "seed",
    "temperature",
    "top_k",
    "top_p",
    "truncate",
    "typical_p",
    "best_of",
    "watermark",
    "details",
    "decoder_input_details",
    "top_n_tokens",
    "grammar",
}
DEFAULT_MAX_NEW_TOKENS = 100  # TGI's default when max_new_tokens is absent


@dataclass(frozen=True)
class TgiRequest:
    inputs: str
    params: SamplingParams  # max_tokens: max_new_tokens (None: as many as fit, at most DEFAULT_MAX_NEW_TOKENS)
    truncate: int | None  # keep only the last N input tokens
    return_full_text: bool
    details: bool
    stream: bool

    @property
    def seed(self) -> int | None:
        """The seed to report: TGI reports one only when sampling."""
        return self.params.seed if self.params.temperature > 0 else None


def parse_tgi(body: dict, context_length: int, max_stop: int = DEFAULT_MAX_STOP_SEQUENCES) -> TgiRequest:
    reject_unknown(body, TGI_FIELDS)
    inputs = string(body, "inputs", required=True)
    p = body.get("parameters")
    if p is None:
        p = {}
    if not isinstance(p, dict):
        raise RequestError("parameters must be an object", "parameters")
    reject_unknown(p, TGI_PARAMETERS)
    only_default(p, "watermark", False)
    only_default(p, "best_of", 1)
    only_default(p, "typical_p", 1.0)
    only_default(p, "decoder_input_details", False)
    only_default(p, "top_n_tokens", 0)
    temperature = number(p, "temperature", None, 0, 100, lo_open=True)
    top_k = number(p, "top_k", None, 1, 1_000_000, integer=True)
    top_p = number(p, "top_p", None, 0, 1, lo_open=True)
    # as in TGI, setting a sampling parameter turns sampling on; otherwise do_sample=false is greedy
    warpers = temperature not in (None, 1.0) or top_k is not None or top_p not in (None, 1.0)
    sampling = boolean(p, "do_sample", False) or warpers
    seed = number(p, "seed", None, 0, 2**64 - 1, integer=True)
    if sampling and seed is None:
        seed = random.SystemRandom().getrandbits(63)  # chosen here so it can be reported in details.seed
    params = SamplingParams(
        temperature=(temperature or 1.0) if sampling else 0.0,
        top_k=top_k or 0,
        top_p=top_p or 1.0,
        stop=stop_list(p, "stop", max_stop),
        seed=seed,
        frequency_penalty=number(p, "frequency_penalty", 0.0, -2, 2),
        repetition_penalty=number(p, "repetition_penalty", 1.0, 0, 100, lo_open=True),
        logprobs=0,  # token logprobs go into every stream event and into details
        grammar=tgi_grammar(p.get("grammar")),
        max_tokens=number(p, "max_new_tokens", None, 1, 1 << 31, integer=True),
    )
    return TgiRequest(
        inputs=inputs,
        params=params,
        truncate=number(p, "truncate", None, 1, context_length, integer=True),
        return_full_text=boolean(p, "return_full_text", False),
        details=boolean(p, "details", False),
        stream=boolean(body, "stream", False),
    )


def tgi_grammar(value, field: str = "grammar") -> Grammar | None:
    """TGI's grammar parameter: ``{"type": "json" | "json_schema", "value": schema}`` or
    ``{"type": "regex", "value": "..."}``."""
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or value.get("type") not in ("json", "json_schema", "regex")
        or value.get("value") is None
    ):
        raise RequestError(f'{field} must be {{"type": "json" or "regex", "value": ...}}', field)
    if value["type"] == "regex":
        return text_grammar("regex", value["value"], f"{field}.value")
    return json_schema(maybe_json(value["value"], f"{field}.value"), f"{field}.value")
