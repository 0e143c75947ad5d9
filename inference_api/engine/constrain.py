"""Grammar-constrained rows: a matcher per row fed each accepted token, and the token mask of only those rows.

``Constraints`` builds matchers off the decode loop: llguidance's tokenizer (once, about a second for a large
vocabulary) and each grammar (a bounded cache keyed by the grammar; each row gets its own copy) are made on a
thread of their own, while the engine keeps stepping the other rows; a request waits for its matcher before it
takes a row. llguidance drops the GIL while it builds, so the decode loop does not wait on it. The thread takes
the teams' grammars in turn (``FairQueue``), at a lower CPU priority than the decode loop, so one team's
flood of large schemas neither delays another team's grammar by more than one compile of each team nor slows
the streams; a grammar that cannot be matched from its first token (llguidance's limits on a parser row) fails
while it is built, before the request takes a row.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .grammar import Grammar

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer

    from ..model.tokenizer import EngineTokenizer

log = logging.getLogger(__name__)

CACHED_GRAMMARS = 64  # compiled grammars kept for reuse, least recently used dropped first
COMPILE_NICENESS = 10  # the compile thread's nice value above the process's: the decode loop comes first
TRIAL_TOKENS = 256  # first tokens a new grammar is tried with (spread over those it allows)


class FairQueue:
    """One worker thread that runs submitted calls, taking the keys (teams) in turn: a key's next call waits
    for every other key's next one, never for all of a key's queue."""

    def __init__(self, name: str, niceness: int = 0):
        self._queues: collections.OrderedDict[Hashable, collections.deque] = collections.OrderedDict()
        self._ready = threading.Condition()
        self._name, self._niceness = name, niceness
        self._thread: threading.Thread | None = None

    def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._ready:
            self._queues.setdefault(key, collections.deque()).append((future, fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._ready.notify()
        return future

    def _next(self) -> tuple[Future, Callable[..., Any], tuple]:
        with self._ready:
            while not self._queues:
                self._ready.wait()
            key, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            del self._queues[key]
            if queue:  # the key goes to the back of the line
                self._queues[key] = queue
            return job

    def _work(self) -> None:
        if self._niceness:
            try:  # Linux: a thread's own priority (its native id is a process id to setpriority)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._niceness)
            except OSError:
                log.warning("could not lower the %s thread's CPU priority", self._name)
        while True:
            future, fn, args = self._next()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)


class Constraints:
    """Matchers for the rows that carry a grammar. ``make_tokenizer``: builds llguidance's tokenizer (lazily,
    on the compile thread, the first time a request brings a grammar)."""

    def __init__(self, make_tokenizer: Callable[[], LLTokenizer]):
        self._make_tokenizer = make_tokenizer
        self._tokenizer: LLTokenizer | None = None
        self._cache: collections.OrderedDict[Grammar, LLMatcher] = collections.OrderedDict()
        self._pool = FairQueue("grammar-compile", COMPILE_NICENESS)
        self._executor: LLExecutor | None = (
            None  # llguidance's, for the masks of a step's constrained rows (made on first use)
        )

    def compile(self, grammar: Grammar, team: Hashable = None) -> Future[LLMatcher]:
        """A future of a fresh matcher for one row (or of the error text, as ValueError); ``team``: whose turn in
        the compile queue it takes."""
        return self._pool.submit(team, self._matcher, grammar)

    def _matcher(self, grammar: Grammar) -> LLMatcher:
        from llguidance import LLMatcher

        template = self._cache.get(grammar)
        if template is None:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            template = LLMatcher(self._tokenizer, grammar.llguidance(), log_level=0)
            if template.is_error():
                raise ValueError(template.get_error())
            _try_first_tokens(template.deep_copy())
            self._cache[grammar] = template
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(grammar)
        return template.deep_copy()

    def mask(
        self, logits: torch.Tensor, rows: list[tuple[int, LLMatcher]], unmasked: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``logits`` with rows ``i`` of ``rows`` (index, matcher) keeping only the tokens their matcher allows;
        every other row untouched (a new tensor: the raw logits stay for log-probs). All rows' masks come from
        one call (llguidance's executor, in parallel, the GIL released) and go on in one pass. ``unmasked``: the
        logits before the rows' min_tokens masks, when there were any; a row those left with nothing the grammar
        allows (a finished grammar allows only the end) takes the grammar's tokens from it."""
        from llguidance import LLExecutor

        if self._executor is None:
            self._executor = LLExecutor(2)
        vocab = logits.shape[-1]
        words = (vocab + 31) // 32
        bits = np.full((logits.shape[0], words), -1, dtype=np.int32)  # unconstrained rows: every token allowed
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in rows], bits.ctypes.data, words * 4, logits.shape[0])
        allowed = torch.from_numpy(np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[:, :vocab])
        allowed = allowed.to(device=logits.device, dtype=torch.bool)
        out = torch.where(allowed, logits, float("-inf"))
        if unmasked is not None:
            empty = torch.isneginf(out).all(dim=-1).nonzero().flatten()
            if empty.numel():
                out[empty] = torch.where(allowed[empty], unmasked[empty], float("-inf"))
        return out


def _try_first_tokens(matcher: LLMatcher, most: int = TRIAL_TOKENS) -> None:
    """ValueError if a token the grammar allows first leaves its parser in error: llguidance checks its limits
    (the items of a parser row: a JSON object of a couple of thousand optional properties) only as it matches,
    which would fail the request at its first token instead of before it takes a row."""
    vocab = matcher.compute_bitmask()
    bits = np.unpackbits(np.frombuffer(bytes(vocab), dtype=np.uint8), bitorder="little")
    allowed = np.flatnonzero(bits)
    for token in allowed[:: max(1, len(allowed) // most)][:most].tolist():
        if matcher.consume_token(token):
            if matcher.is_error():
                break
            matcher.rollback(1)
        elif matcher.is_error():
            break
    if matcher.is_error():
        raise ValueError(matcher.get_error().split("\n")[0])


def for_tokenizer(tokenizer: EngineTokenizer, vocab_size: int, eos_ids) -> Constraints:
    """Constraints over a fast tokenizer's vocabulary (its JSON), the logits ``vocab_size`` wide."""

    def make():
        from llguidance import LLTokenizer

        return LLTokenizer(llguidance_json(tokenizer.to_json()), n_vocab=vocab_size, eos_token=sorted(eos_ids))

    return Constraints(make)


def llguidance_json(tokenizer_json: str) -> str:
    """The tokenizer's JSON as llguidance reads it. A tokenizer converted from a GGUF by transformers has one
    decoder sequence for every vocabulary kind (byte fallback, the SentencePiece space, byte-level); llguidance
    tells a byte-level vocabulary (GPT-2's, where 'Ġ' is a space) only by a ByteLevel decoder of its own, so a
    sequence that holds one becomes it."""
    import json

    spec = json.loads(tokenizer_json)
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "Sequence" and any(d.get("type") == "ByteLevel" for d in decoder.get("decoders", [])):
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    spec.pop("padding", None), spec.pop("truncation", None)
    return json.dumps(spec)
