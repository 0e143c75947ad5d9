"""One request inside the engine: its tokens, its row, its status, and the text it has streamed."""

from __future__ import annotations

import enum
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from typing import TYPE_CHECKING

from .detokenize import IncrementalDetokenizer
from .messages import FinishReason, GenerateRequest, SamplingParams, TokenLogprob
from .reasoning import Thought
from .speculative import RowDrafts
from .stopping import check_stop

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher


class Status(enum.Enum):
    WAITING = "waiting"  # queued for a free row
    PREFILL = "prefill"  # in a row, prompt partly in the KV cache
    DECODE = "decode"  # prompt cached; one token per step
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request: GenerateRequest,
        decode: Callable[[Seq[int]], str],
        index: int = 0,
        adapters: tuple[tuple[int, float], ...] = (),
        adapter_tag: str = "",
    ):
        """adapters: its LoRA adapters as the runner applies them, (slot, scale) pairs; adapter_tag: what they are
        (each one's content digest and scale: engine/adapters.py)."""
        self.session_id = request.session_id
        self.team = request.team
        # whose prefix cache it reads and writes: its team's, within it the request's cache_salt (prefix.py), and
        # its adapters' (keys and values computed with one adapter set are never another's)
        self.namespace: tuple = (request.team, request.params.cache_salt)
        if adapter_tag:
            self.namespace += (adapter_tag,)
        self.adapters = adapters
        self.arrival = 0  # the request's place in arrival order (Scheduler.arrive): prompts are computed in it
        self.index = index  # which of the request's n choices this is
        self.params: SamplingParams = request.params
        self.prompt_ids: list[int] = list(request.prompt_ids)
        self.output_ids: list[int] = []
        self.status = Status.WAITING
        self.row: int | None = None
        self.num_cached = 0  # tokens already written to this row's KV cache
        self.num_reused = 0  # prompt tokens found already cached (the prefix cache) and not computed again
        self.finish_reason: FinishReason | None = None
        self._detok = IncrementalDetokenizer(decode, self.prompt_ids)
        self._text = ""  # decoded output so far
        self._sent = 0  # characters of _text already streamed
        self._checked = 0  # characters of _text already searched for stop sequences
        self.pending_ids: list[int] = []  # tokens not yet reported in an event
        self.pending_logprobs: list[TokenLogprob] = []
        # a reasoning model's thought (SamplingParams.reasoning): found in the text, its budget, its forced close
        reasoning = request.params.reasoning
        self.thought = Thought(reasoning, constrained=request.params.grammar is not None) if reasoning else None
        self.pending_reasoning = ""  # the thought's text not yet reported in an event (split from the answer's)
        self.drafts: RowDrafts | None = None  # its prompt lookup and back-off, once it drafts (speculative.py)
        # an input to embed (--embedding): its tokens' vectors pooled as its prompt is computed, no token sampled
        self.embeds = False
        self.normalize = True
        self.pooled: torch.Tensor | None = None  # the sum of its tokens' vectors (mean), or the last one's (last)
        self.draft_cached = 0  # with a draft model: the positions of its row the draft model's cache holds
        self.draft_base = 0  # (the tokens it had when it last drafted)
        self.matcher: LLMatcher | None = None  # llguidance's matcher for a request with a grammar (engine/constrain.py)
        self.forks: list[Sequence] = []  # choice 0 of n: the other choices, held until its prompt is cached
        self.future: Future[LLMatcher] | None = None  # a held choice's matcher being built (a request with a grammar)
        # choice 0 of a request with prompt_logprobs: each prompt token's log-prob, gathered as its prompt is
        # computed (in full: such a request reuses no cached prefix); None otherwise
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if index == 0 and request.params.prompt_logprobs is not None else None
        )

    # derived values
    @property
    def key(self) -> tuple[str, int]:
        return self.session_id, self.index

    @property
    def held_row(self) -> int:
        """The row of a sequence that holds one (admitted, not yet released)."""
        if self.row is None:
            raise RuntimeError(f"choice {self.index} of request {self.session_id} holds no row")
        return self.row

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill returns every prompt position's logits (for prompt log-probs)."""
        return self.prompt_logprobs is not None

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + self.num_output

    @property
    def prefill_remaining(self) -> int:
        return self.num_prompt - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def grammar_active(self) -> bool:
        """Whether a grammar (if the row has one) constrains its next token: not inside a thought."""
        return self.thought is None or self.thought.grammar_active

    @property
    def forced(self) -> int | None:
        """The token the row must take next (a thought's close, past its budget), or None: the sampler's draw."""
        return self.thought.forced[0] if self.thought is not None and self.thought.forced else None

    @property
    def may_draft(self) -> bool:
        """Whether its next tokens may be drafted and checked in one forward: not where a token's mask or
        penalty depends on the ones before it in the same forward (a grammar, penalties, a forced close, a thought
        whose budget may force one)."""
        p = self.params
        penalised = p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
        budgeted = self.thought is not None and self.thought.open and self.thought.spec.budget is not None
        return p.speculate and p.grammar is None and not penalised and self.forced is None and not budgeted

    @property
    def reasoning_tokens(self) -> int:
        return self.thought.tokens if self.thought is not None else 0

    def early(self, ahead: int = 0) -> bool:
        """The min_tokens rule: whether output token number ``num_output + ahead`` (from 1) comes before
        min_tokens, where no end token, stop token or stop string ends the output (the engine masks the tokens
        before it samples, ``ahead`` 1; ``append`` ignores the stops after, ``ahead`` 0)."""
        return self.num_output + ahead <= self.params.min_tokens

    def at_length(self, context_length: int, ahead: int = 0) -> bool:
        """The length rule: whether the output has reached max_tokens or the context ``ahead`` tokens from now
        (``append`` ends the output with 0; the engine's launch-ahead asks 1: whether this step's token ends it)."""
        limit = self.params.max_tokens
        return (limit is not None and self.num_output + ahead >= limit) or self.num_tokens + ahead >= context_length

    def append(self, token_id: int, eos_ids: frozenset[int], context_length: int) -> str:
        """Add a sampled token; update status; return the text now safe to stream."""
        self.output_ids.append(token_id)
        early = self.early()
        if token_id in eos_ids and not self.params.ignore_eos and not early:
            return self.finish(FinishReason.EOS)
        if token_id in self.params.stop_token_ids and not early:
            return self.finish(FinishReason.STOP)
        self._text += self._detok.add(token_id)
        if self.thought is not None:
            self.thought.update(self._text, token_id)
        stop = check_stop(self._text, self.params.stop if not early else (), self._checked)  # as vLLM: none early
        self._checked = len(self._text)
        if stop.stopped:
            self._text = self._text[: stop.safe_len]
            return self.finish(FinishReason.STOP)
        if self.at_length(context_length):
            return self.finish(FinishReason.LENGTH)
        return self._take(stop.safe_len)

    def finish(self, reason: FinishReason) -> str:
        """End the sequence; return whatever held-back text may still be sent."""
        self.status = Status.FINISHED
        self.finish_reason = reason
        if reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.EOS):
            return self._take(len(self._text), finished=True)
        return ""

    def _take(self, upto: int, finished: bool = False) -> str:
        """The answer's text up to ``upto`` not yet sent; a thought's text goes to ``pending_reasoning``."""
        if self.thought is None:
            piece = self._text[self._sent : upto]
        else:
            upto = max(self._sent, self.thought.safe(self._text, upto, finished))
            thought, piece = self.thought.split(self._text, self._sent, upto, finished)
            self.pending_reasoning += thought
        self._sent = max(self._sent, upto)
        return piece
