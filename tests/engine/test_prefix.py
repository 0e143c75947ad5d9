"""The prefix index: common prefixes across the comparison's chunk edges, the longest row, the limit."""

from __future__ import annotations

import pytest

from inference_api.engine.prefix import CHUNK, PrefixIndex, common_prefix


@pytest.mark.parametrize("split", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
def test_common_prefix_ends_at_the_first_difference(split):
    a = list(range(300))
    b = a[:split] + [-1] + a[split + 1 :]
    assert common_prefix(a, b) == split
    assert common_prefix(a, a[:split]) == split and common_prefix(a, a) == 300


def test_longest_prefers_the_longest_match_counts_rows_in_use_and_respects_the_limit():
    index = PrefixIndex(3)
    index.hold(0, [1, 2, 3])
    index.hold(1, [1, 2, 3, 4, 5, 6])
    assert index.longest([1, 2, 3, 4, 9], {}, limit=4) == (1, 4)
    assert index.longest([1, 2, 3, 4, 5, 6], {}, limit=5) == (1, 5)  # the last prompt token is computed
    assert index.longest([1, 2, 3, 4, 5, 6, 7], {2: [1, 2, 3, 4, 5, 6, 7, 8]}, limit=6) == (2, 6)
    assert index.longest([7, 2, 3], {}, limit=2) == (-1, 0)
    index.hold(1, [])  # a row whose cache cannot be trusted
    assert index.longest([1, 2, 3, 4, 9], {}, limit=4) == (0, 3)


def test_a_row_that_no_longer_holds_the_prefix_is_passed_over():
    index = PrefixIndex(2)
    index.hold(0, list(range(1, 101)))  # wrote 100 positions; a ring keeps only the last of them
    index.hold(1, list(range(1, 11)) + [99])

    def holds(cached: int, length: int) -> bool:
        return cached - 40 <= length - 16  # a ring of 40 slots over a window of 16

    assert index.longest(list(range(1, 21)), {}, limit=19, holds=holds) == (1, 10)  # row 0's match is gone
    assert index.longest(list(range(1, 101)) + [5], {}, limit=100, holds=holds) == (0, 100)
    assert index.longest(list(range(1, 21)), {}, limit=19) == (0, 19)  # without rings: the longest
