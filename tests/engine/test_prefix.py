"""The prefix index: common prefixes across the comparison's chunk edges, the longest row, the limit, and the
namespaces that keep one team's cache from another."""

from __future__ import annotations

import pytest

from inference_api.engine.prefix import CHUNK, PrefixIndex, common_prefix

NS = (None, None)  # the namespace of requests without a team or cache_salt


@pytest.mark.parametrize("split", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
def test_common_prefix_ends_at_the_first_difference(split):
    a = list(range(300))
    b = a[:split] + [-1] + a[split + 1 :]
    assert common_prefix(a, b) == split
    assert common_prefix(a, a[:split]) == split and common_prefix(a, a) == 300


def test_longest_prefers_the_longest_match_counts_rows_in_use_and_respects_the_limit():
    index = PrefixIndex(3)
    index.hold(0, NS, [1, 2, 3])
    index.hold(1, NS, [1, 2, 3, 4, 5, 6])
    assert index.longest([1, 2, 3, 4, 9], NS, {}, limit=4) == (1, 4)
    assert index.longest([1, 2, 3, 4, 5, 6], NS, {}, limit=5) == (1, 5)  # the last prompt token is computed
    assert index.longest([1, 2, 3, 4, 5, 6, 7], NS, {2: (NS, [1, 2, 3, 4, 5, 6, 7, 8])}, limit=6) == (2, 6)
    assert index.longest([7, 2, 3], NS, {}, limit=2) == (-1, 0)
    index.hold(1, NS, [])  # a row whose cache cannot be trusted
    assert index.longest([1, 2, 3, 4, 9], NS, {}, limit=4) == (0, 3)


def test_a_row_that_no_longer_holds_the_prefix_is_passed_over():
    index = PrefixIndex(2)
    index.hold(0, NS, list(range(1, 101)))  # wrote 100 positions; a ring keeps only the last of them
    index.hold(1, NS, list(range(1, 11)) + [99])

    def holds(cached: int, length: int) -> bool:
        return cached - 40 <= length - 16  # a ring of 40 slots over a window of 16

    assert index.longest(list(range(1, 21)), NS, {}, limit=19, holds=holds) == (1, 10)  # row 0's match is gone
    assert index.longest(list(range(1, 101)) + [5], NS, {}, limit=100, holds=holds) == (0, 100)
    assert index.longest(list(range(1, 21)), NS, {}, limit=19) == (0, 19)  # without rings: the longest


def test_a_prompt_reuses_only_its_own_namespaces_rows():
    """A team's prompt never finds another team's (or another cache_salt's) tokens, free or in use; its own it does."""
    team_a, team_b, salted = ("a", None), ("b", None), ("a", "s")
    index = PrefixIndex(3)
    index.hold(0, team_a, [1, 2, 3, 4, 5])
    secret = [1, 2, 3, 4, 5, 6]
    assert index.longest(secret, team_b, {}, limit=5) == (-1, 0)
    assert index.longest(secret, team_b, {1: (team_a, [1, 2, 3, 4, 5, 6, 7])}, limit=5) == (-1, 0)
    assert index.longest(secret, salted, {}, limit=5) == (-1, 0)
    assert index.longest(secret, NS, {}, limit=5) == (-1, 0)
    assert index.longest(secret, team_a, {}, limit=5) == (0, 5)
    index.hold(2, team_b, [1, 2])
    assert index.longest(secret, team_b, {}, limit=5) == (2, 2)
