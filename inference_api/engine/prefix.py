"""Which tokens each free row's KV cache still holds, and the longest prefix of a new prompt found in any row.

A row keeps its keys and values after its request ends, until another request is written over them. Free
rows are recorded here when released; rows in use are passed in by the engine (their sequence's cached tokens).

Every row's tokens belong to a namespace (the team that wrote them and the request's ``cache_salt``), and a
prompt reuses only its own namespace's rows: whether a prefix is cached, in ``cached_tokens`` or in the time to
the first token, would otherwise tell one team what another team's prompts and answers hold.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
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


Held = tuple[Hashable, Seq[int]]  # a row's namespace and the tokens at its positions 0..


class PrefixIndex:
    def __init__(self, rows: int):
        self._held: list[Held] = [(None, []) for _ in range(rows)]  # free rows

    def hold(self, row: int, namespace: Hashable, tokens: list[int]) -> None:
        """Record what a row's cache holds as the row is freed ([] if it cannot be trusted), and for whom."""
        self._held[row] = (namespace, tokens)

    def held(self, row: int) -> Held:
        """What a free row's cache holds, and for whom."""
        return self._held[row]

    def longest(
        self,
        prompt: Seq[int],
        namespace: Hashable,
        in_use: Mapping[int, Held],
        limit: int,
        holds: Callable[[int, int], bool] | None = None,
    ) -> tuple[int, int]:
        """(row, length) of the longest prefix of prompt, at most limit tokens, that a row of the same namespace
        holds; rows in use are given by in_use (row -> (namespace, tokens cached)), the others by what they held
        when freed. holds(cached, length): whether a row that wrote cached positions still holds a reuse of
        length (a sliding-window layer's ring keeps only its last positions); None: always. (-1, 0) if none."""
        best_row, best = -1, 0
        for row, held in enumerate(self._held):
            owner, tokens = in_use.get(row, held)
            if owner == namespace and len(tokens) > best and tokens[0:1] == prompt[0:1]:
                n = common_prefix(prompt, tokens)
                if n > best and (holds is None or holds(len(tokens), min(n, limit))):
                    best_row, best = row, n
        return (best_row, min(best, limit)) if best_row >= 0 and limit > 0 else (-1, 0)
