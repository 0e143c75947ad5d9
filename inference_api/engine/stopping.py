"""Stop-sequence matching over streamed text, with holdback of possible stop prefixes.

Pure functions: given the text produced so far, say how much of it is safe to send and whether a
stop sequence has matched. Nothing that might turn out to be the start of a stop sequence is sent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    safe_len: int  # characters of the text that may be sent
    stopped: bool  # a stop sequence matched; the output ends at safe_len


def check_stop(text: str, stops: tuple[str, ...], start: int = 0) -> StopCheck:
    """Look for the earliest stop sequence in ``text``, searching from ``start`` (text before it was checked)."""
    first = -1
    for stop in stops:
        # a match may begin up to len(stop)-1 characters before the new text
        idx = text.find(stop, max(0, start - len(stop) + 1))
        if idx != -1 and (first == -1 or idx < first):
            first = idx
    if first != -1:
        return StopCheck(first, True)
    return StopCheck(len(text) - held_back(text, stops), False)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop sequence.

    Only suffixes that begin with the stop's first character can match, so the search jumps between those
    (a plain scan of every suffix length would cost O(len(stop)^2) per token)."""
    longest = 0
    for stop in stops:
        window = text[-(len(stop) - 1) :] if len(stop) > 1 else ""
        i = window.find(stop[0]) if window else -1
        while i != -1 and len(window) - i > longest:
            if stop.startswith(window[i:]):
                longest = len(window) - i
                break
            i = window.find(stop[0], i + 1)
    return longest
