"""Constrained output: the one description of a grammar a request may carry, and its check.

Every API's constraint (OpenAI's ``response_format``, vLLM's ``guided_*`` and ``structured_outputs``, TGI's
``grammar``, llama-stack's ``response_format``, the offline ``SamplingParams``) becomes a ``Grammar``: a kind
and its text. llguidance (``llguidance``: a Rust library with no dependencies beyond itself) turns it into a
matcher in the engine (``engine/constrain.py``); here it is only checked, with no tokenizer, so that a schema
feature it cannot enforce is refused with the request, never answered unconstrained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from ..request_errors import RequestError

if TYPE_CHECKING:
    from llguidance import GrammarFormat
    from llguidance._lib import JsonCompileOptions

# llguidance's format names; "grammar" is EBNF as vLLM and llama.cpp write it (GBNF), or Lark
KINDS = ("json_schema", "regex", "choice", "grammar")
MAX_GRAMMAR_BYTES = 64 * 1024  # the largest schema, regex or grammar text a request may send
MAX_CHOICES = 256  # guided_choice's strings


@dataclass(frozen=True)
class Grammar:
    kind: str  # one of KINDS
    text: str  # the schema as JSON, the regex, the choices as a JSON list, or the grammar's text

    def llguidance(self) -> str:
        """The grammar in llguidance's own form (raises ValueError on text it cannot read)."""
        from llguidance import LLMatcher, grammar_from

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
        return grammar_from(cast("GrammarFormat", self.kind), self.text)  # KINDS are llguidance's format names


# Whitespace between JSON tokens: any, as JSON allows, but at most 20 characters at each place (as llama.cpp's
# JSON grammars do): unbounded, a small model fills max_tokens with newlines and never closes the object.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}


ANY_JSON_OBJECT = Grammar("json_schema", json.dumps({"type": "object"}))


def json_schema(schema, field: str) -> Grammar:
    """A JSON schema (an object, or a boolean schema) as a grammar."""
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"{field} must be a JSON schema (an object)", field)
    return checked(Grammar("json_schema", json.dumps(bounded_integers(schema))), field)


SAFE_INTEGER = 2**53 - 1  # JSON's interoperable integers (RFC 8259): what JavaScript reads exactly
_VALUES = {"enum", "const", "default", "examples"}  # keys whose values are data, not schemas


def bounded_integers(schema):
    """The schema with every integer that has no bound given JSON's safe range: a range is a finite set of
    digit strings, where an unbounded integer lets a small model write digits until max_tokens."""
    if isinstance(schema, list):
        return [bounded_integers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _VALUES else bounded_integers(v)) for k, v in schema.items()}
    kinds = out.get("type")
    if kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out


def choice(options, field: str) -> Grammar:
    if (
        not isinstance(options, list)
        or not options
        or len(options) > MAX_CHOICES
        or not all(isinstance(o, str) for o in options)
    ):
        raise RequestError(f"{field} must be a list of 1 to {MAX_CHOICES} strings", field)
    return checked(Grammar("choice", json.dumps(options)), field)


def text_grammar(kind: str, text, field: str) -> Grammar:
    """A regex or an EBNF/Lark grammar given as a string."""
    if not isinstance(text, str) or not text:
        raise RequestError(f"{field} must be a non-empty string", field)
    return checked(Grammar(kind, text), field)


def checked(grammar: Grammar, field: str) -> Grammar:
    """The grammar, once llguidance accepts it (400 naming the problem otherwise)."""
    if len(grammar.text.encode()) > MAX_GRAMMAR_BYTES:
        raise RequestError(f"{field} is longer than {MAX_GRAMMAR_BYTES} bytes", field)
    from llguidance import LLMatcher

    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar.llguidance())
    except ValueError as err:
        raise RequestError(f"{field}: {err}", field) from None
    if is_error:
        raise RequestError(f"{field} cannot be enforced: {messages[0]}", field)
    return grammar


def response_format(value, field: str = "response_format") -> Grammar | None:
    """OpenAI's response_format (text, json_object, json_schema with its schema), and TGI's forms of it
    (``{"type": "json" | "json_object", "value": schema}``, ``{"type": "regex", "value": ...}``)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise RequestError(f"{field} must be an object with a type", field)
    kind = value["type"]
    if kind == "text":
        return None
    if kind in ("json", "json_object") and value.get("value") is not None:  # TGI's: the schema as value
        return json_schema(_maybe_json(value["value"], f"{field}.value"), f"{field}.value")
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError(f"{field}.json_schema must be an object with a schema", f"{field}.json_schema")
        schema = spec.get("schema", {"type": "object"} if "schema" not in spec else None)
        return json_schema(_maybe_json(schema, f"{field}.json_schema.schema"), f"{field}.json_schema.schema")
    if kind == "regex" and value.get("value") is not None:
        return text_grammar("regex", value["value"], f"{field}.value")
    raise RequestError(f"{field}.type {kind!r} is not supported; use text, json_object or json_schema", field)


def _maybe_json(value, field: str):
    """A schema sent as a JSON string (vLLM's guided_json and TGI accept both) as the object it holds."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise RequestError(f"{field} is not valid JSON", field) from None
    return value


# vLLM's structured outputs: the older guided_* fields, the newer structured_outputs object
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object"}


def vllm_guided(body: dict) -> Grammar | None:
    """vLLM's guided_json / guided_regex / guided_choice / guided_grammar, or structured_outputs: at most one."""
    found = [(GUIDED_FIELDS[f], body[f], f) for f in GUIDED_FIELDS if body.get(f) is not None]
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise RequestError("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(
            set(outputs)
            - STRUCTURED_KEYS
            - {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "backend"}
        )
        if unknown:
            raise RequestError(f"structured_outputs.{unknown[0]} is not supported", f"structured_outputs.{unknown[0]}")
        found += [
            (k, outputs[k], f"structured_outputs.{k}")
            for k in sorted(STRUCTURED_KEYS)
            if outputs.get(k) not in (None, False)
        ]
    if not found:
        return None
    if len(found) > 1:
        raise RequestError(f"{found[0][2]} and {found[1][2]} cannot be combined: give one constraint", found[1][2])
    kind, value, field = found[0]
    if kind == "json":
        return json_schema(_maybe_json(value, field), field)
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "choice":
        return choice(value, field)
    return text_grammar(kind, value, field)


def one_of(*grammars: Grammar | None, field: str) -> Grammar | None:
    """The request's one grammar (several constraints at once: 400)."""
    given = [g for g in grammars if g is not None]
    if len(given) > 1:
        raise RequestError("give one output constraint (response_format or a guided field), not several", field)
    return given[0] if given else None


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
    return json_schema(_maybe_json(value["value"], f"{field}.value"), f"{field}.value")


def llama_stack_format(value, field: str = "response_format") -> Grammar | None:
    """llama-stack's response_format: ``{"type": "json_schema", "json_schema": schema}`` or
    ``{"type": "grammar", "bnf": {...}}`` (a GBNF grammar, as its own root rule ``root``)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("json_schema", "grammar"):
        raise RequestError(f"{field}.type must be json_schema or grammar", f"{field}.type")
    if value["type"] == "json_schema":
        return json_schema(_maybe_json(value.get("json_schema"), f"{field}.json_schema"), f"{field}.json_schema")
    bnf = value.get("bnf")
    if isinstance(bnf, dict):  # llama-stack sends the grammar as {"root": "..."} or {"grammar": "..."}
        bnf = bnf.get("grammar") or "\n".join(f"{k} ::= {v}" for k, v in bnf.items())
    return text_grammar("grammar", bnf, f"{field}.bnf")


def native_grammar(body: dict) -> Grammar | None:
    """The native API's fields, named as vLLM names them: json_schema, regex, choice, grammar (one of them)."""
    given = [k for k in ("json_schema", "regex", "choice", "grammar") if body.get(k) is not None]
    if len(given) > 1:
        raise RequestError(f"{given[0]} and {given[1]} cannot be combined: give one constraint", given[1])
    if not given:
        return None
    k = given[0]
    if k == "json_schema":
        return json_schema(_maybe_json(body[k], k), k)
    if k == "choice":
        return choice(body[k], k)
    return text_grammar(k, body[k], k)
