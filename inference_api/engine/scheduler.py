"""The scheduler: which requests hold rows, what each row reuses from the prefix cache, and what runs this step.

It decides and keeps the books; it never touches a tensor (the runner builds every batch). Each step, the
engine asks it to ``admit`` waiting requests into free rows (with the prefix each may copy from another
row of its namespace), then for the ``Step`` to run: up to ``prefill_chunk`` tokens of prompt chunks, packed
with their padding and shared fairly between the prompts in arrival order (``fair_chunks``), and every decoding
row. After the forward, ``computed`` records what the cache now holds.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from .messages import EngineStats
from .prefix import PrefixIndex
from .prompt_cache import MIN_TOKENS, PromptCache
from .rows import RowTable
from .sequence import Sequence, Status

# prompt tokens each prompt computes at least when several share a step's chunk: more prompts than the chunk
# holds at this share wait for the next step (in arrival order). The default chunk (512) holds 64 at this share,
# more than the rows, so every prompt in a row moves on in every step
MIN_SHARE = 8
# a prompt with at most this share of the chunk left is short: short prompts may have a step to themselves (and
# the decoding rows), every other step at most, so a question's first token waits for the step in progress and
# one small step, not for a share of a step full of long prompts
SHORT_PROMPT_SHARE = 8


def fair_chunks(needs: list[int], budget: int, least: int = MIN_SHARE) -> list[int]:
    """How many tokens each prompt (in arrival order, ``needs``: the tokens each has left) computes this step:
    as many prompts as can share ``budget`` tokens with their padding (every chunk is as wide as the widest)
    while each gets at least ``least`` tokens (or all it needs), each up to an equal share. So a short prompt
    finishes in the first step it shares with a long one, and a long prompt never holds the others back; the
    first prompts are taken when not all fit."""
    for k in range(len(needs), 0, -1):
        widest = max(needs[:k])
        width = min(budget // k, widest)
        if k == 1 or width >= min(least, widest):
            return [min(n, width) for n in needs[:k]]
    return []


@dataclass
class Admission:
    seq: Sequence
    copy_from: int | None = None  # the row whose cache holds the reused prefix, when it is not seq's own
    length: int = 0  # prompt tokens reused from the prefix cache
    restore: str | None = None  # the prompt cache's entry holding the reused prefix (instead of a row)
    evict: tuple[Hashable, list[int]] | None = None  # what the row held, to keep before it is written over


@dataclass
class Step:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens of its prompt to compute)
    decode: list[Sequence] = field(default_factory=list)  # one token each, in row order

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    def __init__(
        self,
        rows: int,
        prefill_chunk: int,
        prefix_cache: bool = True,
        context_length: int = 0,
        holds: Callable[[int, int], bool] | None = None,
        prompt_cache: PromptCache | None = None,
    ):
        self.rows = RowTable(rows)
        self.prompt_cache = prompt_cache if prefix_cache else None  # the caches beyond the rows (prompt_cache.py)
        self.prefill_chunk = prefill_chunk
        self.context_length = context_length  # KV positions per row (for the stats' cache occupancy)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # row -> sequence
        self.prefixes = PrefixIndex(rows) if prefix_cache else None
        self.holds = holds  # whether a row's cache still holds a prefix (PrefixIndex.longest)
        self.prefix_queried = 0  # prompt tokens of admitted requests looked up in the prefix cache, ever
        self.prefix_hits = 0  # of them, the tokens reused from some row's cache
        self._arrivals = itertools.count()
        self._short_step = False  # whether the last step's prompts were the short ones alone

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self, **engine_books) -> EngineStats:
        """Built after every step: one pass over the rows in use for the cache positions they hold; engine_books:
        the fields the engine keeps (its decode steps)."""
        return EngineStats(
            rows_in_use=self.rows.num_used,
            rows_total=self.rows.num_rows,
            waiting=len(self.waiting),
            kv_tokens_in_use=sum(s.num_cached for s in self.running.values()),
            kv_tokens_total=self.rows.num_rows * self.context_length,
            prefix_queried_tokens=self.prefix_queried,
            prefix_hit_tokens=self.prefix_hits,
            **engine_books,
        )

    def arrive(self, seqs: list[Sequence]) -> None:
        """Stamp a new request's choices with its place in arrival order (prompts are computed in that order)."""
        order = next(self._arrivals)
        for seq in seqs:
            seq.arrival = order

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue a request; ``first``: ahead of the others (the other choices of a request already admitted)."""
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def admit(self) -> list[Admission]:
        """Move waiting requests into free rows, each starting after the longest prefix of its prompt that a row
        of its namespace holds (to be copied into its row when another row holds it), as llama.cpp's prompt cache
        and vLLM's prefix caching do. The last prompt token is always computed: its logits give the first
        token."""
        admitted = []
        while self.waiting and self.rows.num_free:
            seq = self.waiting[0]
            src, length = -1, 0
            # prompt log-probs and an embedding's mean need every position
            if self.prefixes is not None and not seq.scores_prompt and not seq.embeds:
                held = {row: (s.namespace, s.all_ids[: s.num_cached]) for row, s in self.running.items()}
                src, length = self.prefixes.longest(seq.prompt_ids, seq.namespace, held, seq.num_prompt - 1, self.holds)
                self.prefix_queried += seq.num_prompt
                self.prefix_hits += length
            restore, stored = self._stored(seq, length)
            # a free row that holds the prefix is taken as it is; else the lowest free row (copied into)
            row = self.rows.allocate(src if length and restore is None else None)
            if row is None:  # (num_free said there is one)
                break
            self.waiting.popleft()
            seq.row = row
            seq.status = Status.PREFILL
            admission = Admission(seq, evict=self._evicted(row, length if src == row and restore is None else 0))
            if restore is not None:
                self.prefix_hits += stored - length
                length = stored
                admission.restore = restore
            elif length and src != row:
                admission.copy_from = src
            if length:
                seq.num_cached = seq.num_reused = admission.length = length
            self.running[row] = seq
            admitted.append(admission)
        return admitted

    def _stored(self, seq: Sequence, length: int) -> tuple[str | None, int]:
        """The prompt cache's entry with a longer prefix of the prompt than any row holds (worth restoring: at
        least MIN_TOKENS more), and its length; (None, 0) if none."""
        if self.prompt_cache is None or seq.scores_prompt or seq.embeds:
            return None, 0
        key, n = self.prompt_cache.longest(seq.prompt_ids, seq.namespace, seq.num_prompt - 1)
        if key is None or n < length + MIN_TOKENS:
            return None, 0
        if self.holds is not None and not self.holds(len(self.prompt_cache.tokens_of(key)), n):
            return None, 0
        return key, n

    def _evicted(self, row: int, kept: int) -> tuple[Hashable, list[int]] | None:
        """What a free row taken for another prompt held beyond the ``kept`` tokens that prompt reuses: kept in the
        prompt cache (by the engine) before it is written over, when it is worth it."""
        if self.prompt_cache is None or self.prefixes is None:
            return None
        owner, tokens = self.prefixes.held(row)
        if len(tokens) - kept < MIN_TOKENS or not self.prompt_cache.needs(owner, tokens):
            return None
        return owner, list(tokens)

    def forget_prefix(self, seq: Sequence) -> None:
        """The prefix could not be copied: the prompt is computed in full (and the hit is taken back, in the same
        step as admit counted it, so the stats never see it)."""
        self.prefix_hits -= seq.num_reused
        seq.num_cached = seq.num_reused = 0

    def schedule(self) -> Step:
        """Prompt chunks of several rows, at most prefill_chunk tokens with their padding, so a long prompt never
        stalls the running streams for more than one bounded piece of work, shared between the prompts in
        arrival order (``fair_chunks``), so no prompt waits behind another's length, short prompts alone every
        other step at most while long ones wait (``SHORT_PROMPT_SHARE``); and every decoding row (never skipped
        for a prompt)."""
        by_row = sorted(self.running.values(), key=lambda s: s.held_row)
        prompts = sorted((s for s in by_row if s.status is Status.PREFILL), key=lambda s: s.arrival)
        short = [s for s in prompts if s.prefill_remaining <= self.prefill_chunk // SHORT_PROMPT_SHARE]
        self._short_step = bool(short) and len(short) < len(prompts) and not self._short_step
        if self._short_step:  # the long prompts go on in the next step
            prompts = short
        chunks = fair_chunks([s.prefill_remaining for s in prompts], self.prefill_chunk)
        return Step(list(zip(prompts, chunks)), [s for s in by_row if s.status is Status.DECODE])

    def computed(self, step: Step) -> list[int]:
        """Record a step's forward as done; return which of its prefill chunks finished their prompt (their
        logits give a first token, as every decoding row's do)."""
        for seq, n in step.prefill:
            seq.num_cached += n
        for seq in step.decode:
            seq.num_cached += 1
        return [i for i, (s, _) in enumerate(step.prefill) if s.prefill_remaining == 0]

    def release(self, seq: Sequence, cache_valid: bool = True) -> None:
        """Free a sequence's row (waiting: drop it from the queue); the row's cache is kept for reuse."""
        if seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.row is not None and self.running.get(seq.row) is seq:
            del self.running[seq.row]
            if self.prefixes is not None:
                self.prefixes.hold(seq.row, seq.namespace, seq.all_ids[: seq.num_cached] if cache_valid else [])
            self.rows.free(seq.row)
        seq.row = None
