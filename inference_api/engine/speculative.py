"""Speculative decoding: drafts of a row's next tokens, checked by the target model in one forward.

Drafts come from the row's own prompt and output (prompt lookup, as llama.cpp's n-gram speculation and vLLM's
``ngram`` method: the tokens that followed the most recent earlier occurrence of the row's last n tokens, n from
``ngram_max`` down to ``ngram_min``). The engine runs a row's last token and its draft as one chunk of k + 1
query positions through the same kernels and KV cache as any step, samples every position as it would sample
that token in its own step (its seed and step number, its masks), and keeps the samples up to and including the
first that differs from the draft. A draft is one token sequence (a point mass), so keeping a sample where it
equals the draft is Leviathan et al.'s rejection sampling for that draft: the tokens are the target's own
samples, the same tokens, seeded or greedy, as with speculation off (the forward of a token is the same whatever
else shares it: the batch-invariance promise). Positions past the first difference wrote keys and values that
the row's length then leaves behind: the next step writes over them, and the prefix cache records only the
tokens kept.

Back-off: a row whose drafts are mostly refused stops drafting for a while (its acceptance, an average over its
recent drafts), and no row drafts when more rows decode than ``max_rows`` (the batch is compute-bound there:
every drafted token costs a token's compute) or when a step's drafts would pass ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

# a row's acceptance below this stops its drafts for a while (doubling each time, up to COOLDOWN_MAX steps)
MIN_ACCEPTANCE = 0.3
COOLDOWN_MIN, COOLDOWN_MAX = 4, 256
EMA = 0.5  # the weight of a draft's own acceptance in the row's average


@dataclass(frozen=True)
class SpecConfig:
    """The engine's speculation (``--spec-type``, ``--spec-draft-max``, ``--spec-ngram-min/max``,
    ``--spec-max-rows``)."""

    draft_max: int = 8  # tokens drafted per row and step at most
    ngram_min: int = 2
    ngram_max: int = 4
    max_rows: int = 8  # no row drafts in a step that decodes more rows than this
    max_tokens: int = 48  # a step's drafted tokens at most, all rows together


class RowDrafts:
    """One row's prompt lookup (an index of its n-grams, kept up to date as its tokens grow) and its back-off."""

    def __init__(self, config: SpecConfig):
        self.config = config
        self.index: dict[tuple[int, ...], int] = {}  # an n-gram -> where what followed its latest occurrence starts
        self.indexed = 1  # positions (ends of n-grams) already in the index
        self.acceptance = 1.0  # the average share of drafted tokens kept
        self.cooldown = 0  # steps left without drafts
        self.penalty = COOLDOWN_MIN  # the next cooldown's length
        self.drafted = self.accepted = 0

    def propose(self, ids: Seq[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the last n of ``ids``, for the
        longest n that occurred (none while cooling down)."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return []
        lo, hi = self.config.ngram_min, self.config.ngram_max
        for i in range(self.indexed, len(ids)):  # n-grams ending at i, whose continuation ids[i] is known
            for n in range(lo, min(hi, i) + 1):
                self.index[tuple(ids[i - n : i])] = i
        self.indexed = max(self.indexed, len(ids))
        for n in range(min(hi, len(ids)), lo - 1, -1):
            at = self.index.get(tuple(ids[-n:]))
            if at is not None:
                return list(ids[at : at + limit])
        return []

    def record(self, drafted: int, kept: int) -> None:
        """A draft's outcome: ``kept`` of its ``drafted`` tokens accepted."""
        self.drafted += drafted
        self.accepted += kept
        self.acceptance = (1 - EMA) * self.acceptance + EMA * (kept / drafted)
        if self.acceptance < MIN_ACCEPTANCE:
            self.cooldown, self.penalty = self.penalty, min(COOLDOWN_MAX, self.penalty * 2)
            self.acceptance = MIN_ACCEPTANCE  # a fresh start after the cooldown
        elif kept == drafted:
            self.penalty = COOLDOWN_MIN


def spec_config(config) -> SpecConfig | None:
    """The speculation a ServerConfig asks for (None: off)."""
    if config.spec_type == "off" or config.spec_draft_max < 1:
        return None
    lo = max(1, config.spec_ngram_min)
    return SpecConfig(config.spec_draft_max, lo, max(lo, config.spec_ngram_max), config.spec_max_rows)


def kept(draft: Seq[int], sampled: Seq[int]) -> int:
    """How many of the draft's tokens the samples confirm: the leading positions where the sample (drawn after the
    tokens before it) is the draft's token."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return n
