"""Which tokens each free row's KV cache still holds, and the longest prefix of a new prompt found in any row.

A row keeps its keys and values after its request ends, until another request is written over them. Free
rows are recorded here when released; rows in use are passed in by the engine (their sequence's cached tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq

CHUNK = 64  # tokens compared per slice: C-speed comparisons, one Python step per chunk


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + CHUNK] == b[i : i + CHUNK]:
        i += CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n)


class PrefixIndex:
    def __init__(self, rows: int):
        self._held: list[list[int]] = [[] for _ in range(rows)]  # free rows: the tokens at positions 0..

    def hold(self, row: int, tokens: list[int]) -> None:
        """Record what a row's cache holds as the row is freed ([] if it cannot be trusted)."""
        self._held[row] = tokens

    def longest(
        self,
        prompt: Seq[int],
        in_use: Mapping[int, Seq[int]],
        limit: int,
        holds: Callable[[int, int], bool] | None = None,
    ) -> tuple[int, int]:
        """(row, length) of the longest prefix of prompt, at most limit tokens, that a row holds; rows in use
        are given by in_use (row -> tokens cached), the others by what they held when freed. holds(cached,
        length): whether a row that wrote cached positions still holds a reuse of length (a sliding-window
        layer's ring keeps only its last positions); None: always. (-1, 0) if none."""
        best_row, best = -1, 0
        for row, held in enumerate(self._held):
            tokens = in_use.get(row, held)
            if len(tokens) > best and tokens[0:1] == prompt[0:1]:
                n = common_prefix(prompt, tokens)
                if n > best and (holds is None or holds(len(tokens), min(n, limit))):
                    best_row, best = row, n
        return (best_row, min(best, limit)) if best_row >= 0 and limit > 0 else (-1, 0)
