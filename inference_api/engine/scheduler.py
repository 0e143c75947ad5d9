"""The scheduler: which requests hold rows, what each row reuses from the prefix cache, and what runs this step.

It decides and keeps the books; it never touches a tensor (the runner builds every batch). Each step, the
engine asks it to ``admit`` waiting requests into free rows (with the prefix each may copy from another
row's cache), then for the ``Step`` to run: up to ``prefill_chunk`` tokens of prompt chunks, packed with their
padding, and every decoding row. After the forward, ``computed`` records what the cache now holds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..messages import EngineStats
from .prefix import PrefixIndex
from .rows import RowTable
from .sequence import Sequence, Status


@dataclass
class Admission:
    seq: Sequence
    copy_from: int | None = None  # the row whose cache holds the reused prefix, when it is not seq's own
    length: int = 0  # prompt tokens reused from the prefix cache


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
    ):
        self.rows = RowTable(rows)
        self.prefill_chunk = prefill_chunk
        self.context_length = context_length  # KV positions per row (for the stats' cache occupancy)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # row -> sequence
        self.prefixes = PrefixIndex(rows) if prefix_cache else None
        self.holds = holds  # whether a row's cache still holds a prefix (PrefixIndex.longest)
        self.prefix_queried = 0  # prompt tokens of admitted requests looked up in the prefix cache, ever
        self.prefix_hits = 0  # of them, the tokens reused from some row's cache

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

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue a request; ``first``: ahead of the others (the other choices of a request already admitted)."""
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def admit(self) -> list[Admission]:
        """Move waiting requests into free rows, each starting after the longest prefix of its prompt that any
        row's cache holds (to be copied into its row when another row holds it), as llama.cpp's prompt cache and
        vLLM's prefix caching do. The last prompt token is always computed: its logits give the first token."""
        admitted = []
        while self.waiting and self.rows.num_free:
            row = self.rows.allocate()
            if row is None:  # (num_free said there is one)
                break
            seq = self.waiting.popleft()
            seq.row = row
            seq.status = Status.PREFILL
            admission = Admission(seq)
            if self.prefixes is not None and not seq.scores_prompt:  # prompt log-probs need every position
                held = {row: s.all_ids[: s.num_cached] for row, s in self.running.items()}
                src, length = self.prefixes.longest(seq.prompt_ids, held, seq.num_prompt - 1, self.holds)
                self.prefix_queried += seq.num_prompt
                self.prefix_hits += length
                if length:
                    seq.num_cached = seq.num_reused = length
                    admission = Admission(seq, None if src == row else src, length)
            self.running[row] = seq
            admitted.append(admission)
        return admitted

    def forget_prefix(self, seq: Sequence) -> None:
        """The prefix could not be copied: the prompt is computed in full (and the hit is taken back, in the same
        step as admit counted it, so the stats never see it)."""
        self.prefix_hits -= seq.num_reused
        seq.num_cached = seq.num_reused = 0

    def schedule(self) -> Step:
        """Prompt chunks of several rows, at most prefill_chunk tokens with their padding, so a long prompt never
        stalls the running streams for more than one bounded piece of work; and every decoding row."""
        step, width = Step(), 0
        by_row = sorted(self.running.values(), key=lambda s: s.held_row)
        for seq in by_row:
            if seq.status is not Status.PREFILL:
                continue
            n = min(seq.prefill_remaining, self.prefill_chunk)
            if step.prefill and (len(step.prefill) + 1) * max(width, n) > self.prefill_chunk:
                break
            step.prefill.append((seq, n))
            width = max(width, n)
        step.decode = [s for s in by_row if s.status is Status.DECODE]
        return step

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
                self.prefixes.hold(seq.row, seq.all_ids[: seq.num_cached] if cache_valid else [])
            self.rows.free(seq.row)
        seq.row = None
