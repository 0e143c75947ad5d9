"""Native request parsing: the ``{"text", ...}`` body of /inference/<model> and /predictions/<model>."""

from __future__ import annotations

from dataclasses import dataclass

from ....config import DEFAULT_MAX_STOP_SEQUENCES
from ....engine.grammar import Grammar, choice, json_schema, maybe_json, text_grammar
from ....engine.messages import SamplingParams
from ....request.validation import SEED_RANGE, boolean, number, penalties, reject_unknown, stop_list, string
from ....request_errors import RequestError

NATIVE_FIELDS = {
    "text",
    "temperature",
    "top_k",
    "top_p",
    "max_tokens",
    "stop_sequence",
    "return_prompt",
    "seed",
    "stream",
    "session_id",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "json_schema",
    "regex",
    "choice",
    "grammar",
}


@dataclass(frozen=True)
class NativeRequest:
    text: str
    params: SamplingParams
    return_prompt: bool
    stream: bool


def parse_native(body: dict, max_stop: int = DEFAULT_MAX_STOP_SEQUENCES) -> NativeRequest:
    reject_unknown(body, NATIVE_FIELDS)
    params = SamplingParams(
        temperature=number(body, "temperature", 1.0, 0, 100),
        top_k=number(body, "top_k", 10, 1, 1000, integer=True),
        top_p=number(body, "top_p", 0.9, 0, 1, lo_open=True),
        max_tokens=number(body, "max_tokens", 128, 1, 2048, integer=True),
        stop=stop_list(body, "stop_sequence", max_stop),
        seed=number(body, "seed", None, *SEED_RANGE, integer=True),
        grammar=native_grammar(body),
        **penalties(body),
    )
    return NativeRequest(
        text=string(body, "text", required=True),
        params=params,
        return_prompt=boolean(body, "return_prompt", False),
        stream=boolean(body, "stream", True),
    )


def native_grammar(body: dict) -> Grammar | None:
    """The native API's fields, named as vLLM names them: json_schema, regex, choice, grammar (one of them)."""
    given = [k for k in ("json_schema", "regex", "choice", "grammar") if body.get(k) is not None]
    if len(given) > 1:
        raise RequestError(f"{given[0]} and {given[1]} cannot be combined: give one constraint", given[1])
    if not given:
        return None
    k = given[0]
    if k == "json_schema":
        return json_schema(maybe_json(body[k], k), k)
    if k == "choice":
        return choice(body[k], k)
    return text_grammar(k, body[k], k)
