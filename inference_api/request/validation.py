"""Field validation for every dialect's parser (no transport): each bad field raises RequestError naming the
field and what it accepts."""

from __future__ import annotations

import json
import math
from typing import Any, Literal, overload

from ..request_errors import RequestError


def reject_unknown(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}; accepted fields: {', '.join(sorted(allowed))}", unknown[0])


def number(
    body: dict[str, Any], name: str, default: Any, lo: float, hi: float, *, integer: bool = False, lo_open: bool = False
) -> Any:
    """A number in [lo, hi] ((lo, hi] when lo_open); numeric strings are accepted, null means the default."""
    value = body.get(name)
    if value is None:
        return default
    bounds = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise RequestError(f"{name} must be {kind} in {bounds}", name)
    parsed: int | float
    if isinstance(value, str):  # a blank string is no number (float("") raises)
        try:
            text = value.strip()
            parsed = int(text) if integer and text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise RequestError(f"{name} must be {kind} in {bounds}, got {value!r}", name) from None
    else:
        parsed = value
    if isinstance(parsed, float) and not math.isfinite(parsed):
        raise RequestError(f"{name} must be a finite number in {bounds}", name)
    if integer:
        if parsed != int(parsed):
            raise RequestError(f"{name} must be {kind} in {bounds}, got {value!r}", name)
        parsed = int(parsed)
    if parsed < lo or parsed > hi or (lo_open and parsed == lo):
        raise RequestError(f"{name} must be {kind} in {bounds}, got {value!r}", name)
    return parsed


def boolean(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false", name)
    return value


@overload
def string(body: dict[str, Any], name: str, *, required: Literal[True], default: str | None = None) -> str: ...
@overload
def string(body: dict[str, Any], name: str, *, required: bool = False, default: str | None = None) -> str | None: ...
def string(body: dict[str, Any], name: str, *, required: bool = False, default: str | None = None) -> str | None:
    """The string field; null or absent is the default, or a 400 when ``required`` (so a str then)."""
    value = body.get(name)
    if value is None:
        if required:
            raise RequestError(f"{name} is required (a non-empty string)", name)
        return default
    if not isinstance(value, str) or (required and not value):
        raise RequestError(f"{name} must be a non-empty string", name)
    return value


MAX_STOP_CHARS = 512  # bounds the engine's per-token stop matching, which every row's request shares


def stop_list(body: dict[str, Any], name: str, max_items: int = 4) -> tuple[str, ...]:
    value = body.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or len(items) > max_items
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in items)
    ):
        raise RequestError(
            f"{name} must be a non-empty string or a list of up to {max_items} non-empty strings, "
            f"each at most {MAX_STOP_CHARS} characters",
            name,
        )
    return tuple(items)


def token_ids(
    body: dict[str, Any], name: str, vocab_size: int, *, required: bool = False, limit: int | None = None
) -> tuple[int, ...]:
    """A list of token ids, each in [0, vocab_size), at most ``limit`` of them."""
    value = body.get(name)
    if value is None and not required:
        return ()
    if (
        not isinstance(value, list)
        or (required and not value)
        or not all(type(t) is int and 0 <= t < vocab_size for t in value)
    ):
        raise RequestError(
            f"{name} must be a {'non-empty ' if required else ''}list of token ids in [0, {vocab_size})", name
        )
    if limit is not None and len(value) > limit:
        raise RequestError(f"{name} takes at most {limit} token ids ({len(value)} given)", name)
    return tuple(value)


def only_default(body: dict[str, Any], name: str, *neutral: Any) -> None:
    """A field the server does not implement: accepted when null or at a value that changes nothing."""
    value = body.get(name)
    if value is None or any(type(value) is type(n) and value == n for n in neutral):
        return
    raise RequestError(f"{name}={json.dumps(value)[:100]} is not supported by this server", name)


SEED_RANGE = (-(2**63), 2**64 - 1)


def penalties(
    body: dict[str, Any],
    presence: str = "presence_penalty",
    frequency: str = "frequency_penalty",
    repetition: str = "repetition_penalty",
) -> dict[str, Any]:
    """The engine's penalties with OpenAI's ranges (repetition: HF's multiplicative penalty, 1 is off)."""
    return {
        "presence_penalty": number(body, presence, 0.0, -2, 2),
        "frequency_penalty": number(body, frequency, 0.0, -2, 2),
        "repetition_penalty": number(body, repetition, 1.0, 0, 10, lo_open=True),
    }
