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

How much to draft: a step that checks drafts costs more than a plain one, a share of a step per drafted token,
more as the batch grows (on the 2-core machine with the embedded model: a plain step of 1 row 5.5 ms, with 8
drafted tokens 12.4; of 8 rows 13.2 ms, with 8 drafted tokens each 75.2). ``StepCosts`` measures both as the
engine runs (a plain step's time by its rows, and what each drafted token adds) and takes a drafted token only
where it raises the step's expected tokens per second: the j-th token of a row whose drafts are accepted at
rate a per token is kept with probability a^j, so it pays while a^j over its cost beats the step's rate so far.
A batch that is compute-bound (many rows: a high rate already) takes only the surest drafts, usually none; a row
whose drafts keep failing drafts nothing until its rate recovers.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from .messages import step_rows_bucket

PRIOR = 0.5  # a new row's acceptance per drafted token, before any of its drafts are checked
EMA = 0.3  # the weight of a draft's outcome in a row's acceptance
RECOVER = 0.02  # a row not drafting moves this share of the way back to PRIOR each step
EMA_COST = 0.2  # the weight of a step's time in the measured costs
REFRESH = 64  # a plain step at least every this many steps of a row count, to keep its time current


@dataclass(frozen=True)
class SpecConfig:
    """The engine's speculation (``--spec-type``, ``--spec-draft-max``, ``--spec-ngram-min/max``,
    ``--spec-max-rows``)."""

    draft_max: int = 16  # tokens drafted per row and step at most
    ngram_min: int = 2
    ngram_max: int = 4
    max_rows: int = 8  # no row drafts in a step that decodes more rows than this
    max_tokens: int = 64  # a step's drafted tokens at most, all rows together


class RowDrafts:
    """One row's prompt lookup (an index of its n-grams, kept up to date as its tokens grow) and its acceptance
    rate per drafted token."""

    def __init__(self, config: SpecConfig):
        self.config = config
        self.index: dict[tuple[int, ...], int] = {}  # an n-gram -> where what followed its latest occurrence starts
        self.indexed = 1  # positions (ends of n-grams) already in the index
        self.acceptance = PRIOR
        self.drafted = self.accepted = 0

    def propose(self, prompt: Seq[int], output: Seq[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the last n of the row's tokens
        (its prompt, then its output), for the longest n that occurred. Only the tokens new since the last call are
        indexed, and nothing the length of the row is copied."""

        def span(a: int, b: int) -> list[int]:  # the row's tokens a..b-1
            p = len(prompt)
            if b <= p:
                return list(prompt[a:b])
            if a >= p:
                return list(output[a - p : b - p])
            return [*prompt[a:], *output[: b - p]]

        total = len(prompt) + len(output)
        lo, hi = self.config.ngram_min, self.config.ngram_max
        for i in range(self.indexed, total):  # n-grams ending at i, whose continuation (token i) is known
            before = span(max(0, i - hi), i)
            for n in range(lo, min(hi, i) + 1):
                self.index[tuple(before[-n:])] = i
        self.indexed = max(self.indexed, total)
        last = span(max(0, total - hi), total)
        for n in range(min(hi, total), lo - 1, -1):
            at = self.index.get(tuple(last[-n:]))
            if at is not None:
                return span(at, min(at + limit, total))
        return []

    def record(self, drafted: int, kept: int) -> None:
        """A draft's outcome: ``kept`` of its ``drafted`` tokens accepted (each of the first kept + 1 was tried)."""
        self.drafted += drafted
        self.accepted += kept
        tried = min(drafted, kept + 1)
        self.acceptance = (1 - EMA) * self.acceptance + EMA * (kept / tried)

    def idle(self) -> None:
        """A step without a draft of its own: its rate drifts back toward the prior (so it is tried again)."""
        self.acceptance += RECOVER * (PRIOR - self.acceptance)


class StepCosts:
    """What steps cost, measured: a plain step's seconds by its rows (``step_rows_bucket``), and the seconds each
    drafted token adds to a step that checks drafts."""

    def __init__(self):
        self.plain: dict[int, float] = {}  # bucket -> seconds of a plain step
        self.since: dict[int, int] = {}  # bucket -> steps with drafts since its last plain step
        self.per_token: float | None = None  # seconds a drafted token adds

    def record(self, rows: int, drafted: int, seconds: float) -> None:
        bucket = step_rows_bucket(rows)
        if drafted == 0:
            old = self.plain.get(bucket)
            self.plain[bucket] = seconds if old is None else (1 - EMA_COST) * old + EMA_COST * seconds
            self.since[bucket] = 0
            if self.per_token is not None:  # unmeasured while nothing drafts: back toward the first guess, so a
                # cost measured in a moment of load does not keep every draft off for good
                self.per_token += RECOVER * (self.guess(rows) - self.per_token)
            return
        self.since[bucket] = self.since.get(bucket, 0) + 1
        base = self.plain.get(bucket)
        if base is not None:
            added = max(0.0, seconds - base) / drafted
            self.per_token = added if self.per_token is None else (1 - EMA_COST) * self.per_token + EMA_COST * added

    def guess(self, rows: int) -> float:
        """A drafted token's cost before one is measured: a share of a plain step (the 2-core machine's: 0.86 ms
        against a 5.5 ms step of one row, about 1 ms against 13.2 ms of 8)."""
        return self.plain.get(step_rows_bucket(rows), 0.0) / (4 + rows)

    def choose(self, rows: int, candidates: dict[int, tuple[list[int], float]], limit: int) -> dict[int, list[int]]:
        """The drafts worth checking this step (each row's leading tokens), from each row's candidates and its
        acceptance: tokens taken surest first while each raises the step's expected tokens per second; none
        until a plain step of this many rows has been timed (or when its time is due again)."""
        bucket = step_rows_bucket(rows)
        base = self.plain.get(bucket)
        if base is None or self.since.get(bucket, 0) >= REFRESH or not candidates:
            return {}
        cost = self.per_token if self.per_token is not None else self.guess(rows)
        expected, seconds, taken, count = float(rows), base, {r: 0 for r in candidates}, 0
        heap = [(-a, r, 1) for r, (draft, a) in candidates.items() if draft and a > 0]
        heapq.heapify(heap)
        while heap and count < limit:
            gain, row, j = heapq.heappop(heap)
            if -gain * seconds <= cost * expected:  # (gain / cost <= expected / seconds: it would lower the rate)
                break
            taken[row], count = j, count + 1
            expected, seconds = expected - gain, seconds + cost
            draft, a = candidates[row]
            if j < len(draft):
                heapq.heappush(heap, (gain * a, row, j + 1))
        return {r: candidates[r][0][:n] for r, n in taken.items() if n}


class ModelDrafter:
    """Drafts from a second, smaller model of the same vocabulary (``--draft-model``, as llama-server's ``-md``):
    its own runner, rows and KV cache beside the target's. Each sequence's draft cache is brought up to the
    sequence's tokens when it drafts (its prompt the first time: one prefill of the small model, in chunks), then
    the draft model writes k tokens greedily, one decode step of every drafting row per token. A greedy draft is
    one token sequence, so the target checks it as it checks a prompt-lookup draft. Afterwards the draft cache
    holds what the target kept: the tokens after the first refused one are written over next time."""

    def __init__(self, runner, chunk: int):
        self.runner = runner
        self.chunk = chunk  # tokens a catch-up prefill writes into a row per forward at most

    def draft(self, seqs: list, lengths: dict[int, int]) -> dict[int, list[int]]:
        """Each sequence's draft (by row) of ``lengths[row]`` tokens."""
        chosen = [s for s in seqs if lengths.get(s.held_row)]
        if not chosen:
            return {}
        # catch up: every token the draft cache lacks, the last one's logits giving the first draft token
        logits = self._catch_up(chosen)
        drafts = {s.held_row: [int(t)] for s, t in zip(chosen, logits.argmax(-1).tolist())}
        going = [s for s in chosen if lengths[s.held_row] > 1]
        while going:
            rows = [s.held_row for s in going]
            positions = [s.num_tokens + len(drafts[r]) - 1 for s, r in zip(going, rows)]
            out = self.runner.decode(rows, [drafts[r][-1] for r in rows], positions).argmax(-1).tolist()
            for r, t in zip(rows, out):
                drafts[r].append(int(t))
            going = [s for s in going if len(drafts[s.held_row]) < lengths[s.held_row]]
        for s in chosen:  # the draft cache now holds the sequence's tokens and the drafted ones but the last
            s.draft_base = s.num_tokens
            s.draft_cached = s.num_tokens + len(drafts[s.held_row]) - 1
        return drafts

    def _catch_up(self, seqs: list):
        """The draft model over each sequence's tokens its cache lacks (in chunks): the logits after its last."""
        import torch

        last = {}
        pending = {s.held_row: s for s in seqs}
        while pending:
            rows, chunks, starts = [], [], []
            for row, s in pending.items():
                start = min(s.draft_cached, s.num_tokens - 1)
                ids = s.all_ids[start : start + self.chunk]
                rows.append(row)
                chunks.append(ids)
                starts.append(start)
                s.draft_cached = start + len(ids)
            logits = self.runner.prefill(rows, chunks, starts)
            for i, row in enumerate(rows):
                if pending[row].draft_cached >= pending[row].num_tokens:
                    last[row] = logits[i]
            pending = {r: s for r, s in pending.items() if s.draft_cached < s.num_tokens}
        return torch.stack([last[s.held_row] for s in seqs])

    @staticmethod
    def kept(seq, drafted: int, kept: int) -> None:
        """After the check: the draft cache holds the sequence's tokens before the step and the kept drafts (all
        but the last of a draft kept whole, which the draft model never read)."""
        seq.draft_cached = min(seq.draft_cached, seq.draft_base + min(kept, drafted - 1))


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
