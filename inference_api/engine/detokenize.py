"""Incremental detokenization that never splits a multi-byte character.

The prefix/read offset scheme of TGI and vLLM: decode a short window of recent tokens twice (with and
without the newest ones) and emit the difference, holding it back while it ends in U+FFFD (an
incomplete UTF-8 sequence). Decoding a window, not the single token, keeps SentencePiece spaces right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int] = ()):
        self._decode = decode
        # a few prompt tokens give the first output token the right leading space
        self.ids: list[int] = list(prompt_ids[-4:])
        self._prefix = 0
        self._read = len(self.ids)
        self.skip = len(self.ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the new complete text (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""
