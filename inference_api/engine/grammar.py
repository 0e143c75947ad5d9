"""Constrained output: the one description of a grammar a request may carry, and its check.

Every API's constraint becomes a ``Grammar``, a kind and its text, parsed once by the dialect that owns the field
(``web/dialects/<api>/protocol.py``: OpenAI's ``response_format`` with vLLM's ``guided_*`` and
``structured_outputs``, TGI's ``grammar``, llama-stack's ``response_format``, the native fields; the offline
``SamplingParams`` through the OpenAI parser) with the builders here; a forced tool call's grammar is merged by
``request.tools.Tools.constrain``. llguidance (``llguidance``: a Rust library with no dependencies beyond itself)
turns it into a matcher in the engine (``engine/constrain.py``); here it is only checked, with no tokenizer, so that
a schema feature it cannot enforce is refused with the request, never answered unconstrained.
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
MAX_GUIDED_CHOICES = 256  # guided_choice's strings


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
        or len(options) > MAX_GUIDED_CHOICES
        or not all(isinstance(o, str) for o in options)
    ):
        raise RequestError(f"{field} must be a list of 1 to {MAX_GUIDED_CHOICES} strings", field)
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


def maybe_json(value, field: str):
    """A schema sent as a JSON string (vLLM's guided_json and TGI accept both) as the object it holds."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise RequestError(f"{field} is not valid JSON", field) from None
    return value


def one_of(*grammars: Grammar | None, field: str) -> Grammar | None:
    """The request's one grammar (several constraints at once: 400)."""
    given = [g for g in grammars if g is not None]
    if len(given) > 1:
        raise RequestError("give one output constraint (response_format or a guided field), not several", field)
    return given[0] if given else None
