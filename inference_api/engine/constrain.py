"""Grammar-constrained rows: a matcher per row fed each accepted token, and the token mask of only those rows.

``Constraints`` builds matchers off the decode loop: llguidance's tokenizer (once, about a second for a large
vocabulary) and each grammar (a bounded cache keyed by the grammar; each row gets its own copy) are made on a
thread of their own, while the engine keeps stepping the other rows; a request waits for its matcher before it
takes a row. llguidance drops the GIL while it builds, so the decode loop does not wait on it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..grammar import Grammar

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer

log = logging.getLogger(__name__)

CACHED_GRAMMARS = 64  # compiled grammars kept for reuse, least recently used dropped first


class Constraints:
    """Matchers for the rows that carry a grammar. ``make_tokenizer``: builds llguidance's tokenizer (lazily,
    on the compile thread, the first time a request brings a grammar)."""

    def __init__(self, make_tokenizer: Callable[[], LLTokenizer]):
        self._make_tokenizer = make_tokenizer
        self._tokenizer: LLTokenizer | None = None
        self._cache: collections.OrderedDict[Grammar, LLMatcher] = collections.OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._executor: LLExecutor | None = (
            None  # llguidance's, for the masks of a step's constrained rows (made on first use)
        )

    def compile(self, grammar: Grammar) -> Future[LLMatcher]:
        """A future of a fresh matcher for one row (or of the error text, as ValueError)."""
        return self._pool.submit(self._matcher, grammar)

    def _matcher(self, grammar: Grammar) -> LLMatcher:
        from llguidance import LLMatcher

        template = self._cache.get(grammar)
        if template is None:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            template = LLMatcher(self._tokenizer, grammar.llguidance(), log_level=0)
            if template.is_error():
                raise ValueError(template.get_error())
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


def for_hf_tokenizer(hf_tokenizer, vocab_size: int, eos_ids) -> Constraints:
    """Constraints over a transformers fast tokenizer's vocabulary, the logits ``vocab_size`` wide."""

    def make():
        from llguidance import LLTokenizer

        return LLTokenizer(
            llguidance_json(hf_tokenizer.backend_tokenizer.to_str()), n_vocab=vocab_size, eos_token=sorted(eos_ids)
        )

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
