"""The sampler: every row's logits pipeline, from the runner's logits to the next tokens and their log-probs.

In order, per step: repetition, presence and frequency penalties (rows that ask), the ``min_tokens`` mask (no end or
stop token before it: ``Sequence.early``), a grammar's mask (rows with a matcher, outside a thought), then one
draw with each row's temperature, top-k, top-p, min-p and seed (``sampling.sample``: on the CPU the kernels' one
call for every row, elsewhere torch's vectorised operations), and a thought's
forced close in place of the draw (past its budget: ``reasoning.Thought``); the log-probs of the chosen tokens and
of a prompt's tokens are read from the same logits. Each row's parameters live in ``RowParams`` on the device,
set once when the row is admitted; a request's ``n`` choices draw from seeds derived from its one seed
(``choice_seed``). No row's mask or penalty touches another row's logits.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from .constrain import Constraints
from .messages import TokenLogprob
from .sampling import RowParams, apply_penalties, choice_seed, mask_tokens, sample
from .sequence import Sequence

# prompt positions whose log-probs are worked out at a time: a float32 log-softmax of 64 x the vocabulary (12 MB
# for 49,152 tokens) beside the chunk's logits, instead of a second copy of all of them
SCORE_SLICE = 64


class Sampler:
    def __init__(
        self,
        rows: int,
        vocab_size: int,
        device: torch.device,
        eos_ids: frozenset[int],
        detokenize: Callable[[Seq[int]], str],
        constraints: Constraints | None = None,
        kernels=None,
    ):
        """kernels: the CPU kernels (their draw for logits on the CPU), or None (torch's)."""
        self.params = RowParams.allocate(rows, vocab_size, device)
        self.kernels = kernels
        self.eos_ids = eos_ids
        self.detokenize = detokenize
        self.constraints = constraints  # None: no grammar support (a row with a matcher is an error)
        self._rng = random.Random()

    def admit(self, seq: Sequence) -> None:
        """The row's parameters, its seed (a choice's own, derived from the request's, or a fresh one) and its
        penalty counts (the prompt's tokens), before its first step."""
        params = seq.params
        seed = choice_seed(params.seed, seq.index) if params.seed is not None else self._rng.getrandbits(63)
        self.params.set_row(seq.held_row, params, seed, seq.prompt_ids)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor, offsets: list[int] | None = None) -> torch.Tensor:
        """Each row's next token (on the logits' device: a launch ahead may read it there). ``offsets``: a
        checked draft's positions, a sequence once per position (logits row i is its token number
        num_output + offsets[i], drawn with that step's seed and masks)."""
        p = self.params
        offsets = offsets or [0] * len(seqs)
        rows = torch.tensor([s.held_row for s in seqs], device=logits.device)
        penalised = any(
            s.params.presence_penalty or s.params.frequency_penalty or s.params.repetition_penalty != 1.0 for s in seqs
        )
        if penalised:
            logits = apply_penalties(logits, rows, p)
        early = [(i, s) for i, (s, j) in enumerate(zip(seqs, offsets)) if s.early(ahead=1 + j)]
        unmasked = None
        if early:  # no end or stop token before min_tokens: each row its own (never another request's) tokens
            cells = [(i, t) for i, s in early for t in self.eos_ids.union(s.params.stop_token_ids)]
            unmasked = logits
            logits = mask_tokens(logits, torch.tensor(cells, dtype=torch.long, device=logits.device).view(-1, 2))
        # a grammar's row: only the tokens its matcher allows (the other rows pay nothing)
        constrained = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None and s.grammar_active]
        if constrained:
            if self.constraints is None:  # (it alone builds matchers)
                raise RuntimeError("rows with a grammar in an engine without grammar support")
            logits = self.constraints.mask(logits, constrained, unmasked)
        steps = torch.tensor([s.num_output + j for s, j in zip(seqs, offsets)], device=logits.device)
        min_p = p.min_p[rows] if any(s.params.min_p for s in seqs) else None
        tokens = sample(
            logits, p.temperature[rows], p.top_k[rows], p.top_p[rows], p.seed[rows], steps, min_p, self.kernels
        )
        forced = [(i, s.forced) for i, s in enumerate(seqs) if s.forced is not None]
        if forced:  # a thought past its budget: its close, in place of the draw (on the device, for a launch ahead)
            at, ids = zip(*forced)
            tokens[torch.tensor(at, device=tokens.device)] = torch.tensor(ids, dtype=tokens.dtype, device=tokens.device)
        if penalised:  # the counts only penalties read; a row's counts start afresh with its request
            p.record(rows, tokens)
        return tokens

    def logprobs(self, seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> dict[int, TokenLogprob]:
        """The chosen token's log-prob and the top N, for the rows (by index in seqs) that ask."""
        idx = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not idx:
            return {}
        lp = torch.log_softmax(logits[idx].float(), dim=-1)
        top_n = max(seqs[i].params.logprobs or 0 for i in idx)
        top_v, top_i = lp.topk(max(top_n, 1), dim=-1)
        out = {}
        decode = self.detokenize
        for j, i in enumerate(idx):
            n = seqs[i].params.logprobs
            top = tuple((decode([t]), v) for t, v in zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()))
            out[i] = TokenLogprob(decode([tokens[i]]), float(lp[j, tokens[i]]), top)
        return out

    def score_prompt(self, seq: Sequence, logits: torch.Tensor, start: int) -> None:
        """The log-probs of the prompt tokens that positions start.. predict (the last prompt position predicts
        the first output token: not a prompt token), added to the request's prompt log-probs."""
        scores = seq.prompt_logprobs
        targets = seq.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
        if scores is None or not targets:  # (only a request that asked for its prompt's log-probs is scored)
            return
        n, decode = seq.params.prompt_logprobs, self.detokenize
        for a in range(0, len(targets), SCORE_SLICE):  # a slice at a time: one copy of the chunk's logits at most
            part = targets[a : a + SCORE_SLICE]
            lp = torch.log_softmax(logits[a : a + len(part)].float(), dim=-1)
            chosen = lp.gather(1, torch.tensor(part, device=lp.device)[:, None])
            ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
            top_v, top_i = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
            for t, v, rank, ids, vals in zip(part, chosen[:, 0].tolist(), ranks, top_i.tolist(), top_v.tolist()):
                top = tuple((decode([i]), x) for i, x in zip(ids, vals))
                scores.append(TokenLogprob(decode([t]), v, top, t, rank, tuple(ids)))
