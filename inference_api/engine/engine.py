"""The engine: admit waiting requests into free rows, run one forward, sample every row, emit text."""
from __future__ import annotations

import logging
import random
from collections import deque
from typing import Protocol, Sequence as Seq

import torch

from ..messages import EngineStats, FinishReason, GenerateRequest, TokenEvent, TokenLogprob
from .prefix import PrefixIndex
from .rows import RowTable
from .sampling import RowParams, apply_penalties, mask_tokens, sample
from .sequence import Sequence, Status

log = logging.getLogger(__name__)


class Runner(Protocol):
    device: torch.device
    vocab_size: int

    def prefill(self, rows: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, active: torch.Tensor) -> torch.Tensor: ...

    def copy_prefix(self, src: int, dst: int, length: int) -> None: ...


class Detokenizer(Protocol):
    def decode(self, ids: Seq[int]) -> str: ...


class Engine:
    def __init__(self, runner: Runner, tokenizer: Detokenizer, rows: int, context_length: int,
                 prefill_chunk: int, eos_ids: frozenset[int], fault_text: str | None = None,
                 prefix_cache: bool = True):
        self.runner = runner
        self.tokenizer = tokenizer
        self.rows = RowTable(rows)
        self.context_length = context_length
        self.prefill_chunk = prefill_chunk
        self.eos_ids = eos_ids
        self.params = RowParams.allocate(rows, runner.vocab_size, runner.device)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # row -> sequence
        self.sessions: dict[str, Sequence] = {}
        self.prefixes = PrefixIndex(rows) if prefix_cache else None
        self._rng = random.Random()
        self.fault_text = fault_text  # tests only: prompts containing it fail in post-processing
        self._faulty: set[str] = set()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def stats(self) -> EngineStats:
        return EngineStats(rows_in_use=self.rows.num_used, rows_total=self.rows.num_rows, waiting=len(self.waiting))

    def add(self, request: GenerateRequest) -> None:
        seq = Sequence(request, self.tokenizer.decode)
        if self.fault_text and self.fault_text in self.tokenizer.decode(seq.prompt_ids):
            self._faulty.add(seq.session_id)
        self.sessions[seq.session_id] = seq
        self.waiting.append(seq)

    def cancel(self, session_id: str) -> None:
        seq = self.sessions.pop(session_id, None)
        self._faulty.discard(session_id)
        if seq is None:
            return
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.finish(FinishReason.CANCELLED)
        self._release(seq)

    def step(self) -> list[TokenEvent]:
        self._admit()
        try:
            seqs, logits = self._forward()
            if not seqs:
                return []
            tokens = self._sample(seqs, logits)
        except Exception as exc:  # a failed forward must not take the process (and every stream) down
            log.exception("engine step failed")
            return self._fail_running(f"engine error: {exc}")
        return self._postprocess(seqs, tokens, logits)

    def _admit(self) -> None:
        while self.waiting and self.rows.num_free:
            seq = self.waiting.popleft()
            seq.row = self.rows.allocate()
            seq.status = Status.PREFILL
            if self.prefixes is not None:
                self._reuse_prefix(seq)
            seed = seq.params.seed if seq.params.seed is not None else self._rng.getrandbits(63)
            self.params.set_row(seq.row, seq.params, seed, seq.prompt_ids)
            self.running[seq.row] = seq

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start the prompt after the longest prefix any row's cache holds (copied into this row if it lies in
        another), as llama.cpp's prompt cache and vLLM's prefix caching do. The last prompt token is always
        computed: its logits give the first output token."""
        held = {row: s.all_ids[:s.num_cached] for row, s in self.running.items() if s is not seq}
        src, length = self.prefixes.longest(seq.prompt_ids, held, limit=seq.num_prompt - 1)
        if length == 0:
            return
        if src != seq.row:
            try:
                self.runner.copy_prefix(src, seq.row, length)
            except Exception:  # the prompt is then computed in full
                log.exception("copying a cached prefix failed")
                return
        seq.num_cached = seq.num_reused = length

    def _forward(self) -> tuple[list[Sequence], torch.Tensor]:
        """Prefill up to one chunk of prompt tokens, then decode every row with a token to feed."""
        parts = [part for part in (self._prefill(), self._decode()) if part[0]]
        if not parts:
            return [], torch.empty(0)
        if len(parts) == 1:
            return parts[0]
        return [s for seqs, _ in parts for s in seqs], torch.cat([logits for _, logits in parts])

    def _prefill(self) -> tuple[list[Sequence], torch.Tensor | None]:
        """One forward over several rows' prompt chunks, at most prefill_chunk tokens with padding, so a
        long prompt never stalls the running streams for more than one bounded piece of work."""
        batch, width = [], 0
        for seq in sorted(self.running.values(), key=lambda s: s.row):
            if seq.status is not Status.PREFILL:
                continue
            n = min(seq.prefill_remaining, self.prefill_chunk)
            if batch and (len(batch) + 1) * max(width, n) > self.prefill_chunk:
                break
            batch.append((seq, n))
            width = max(width, n)
        if not batch:
            return [], None
        logits = self.runner.prefill([s.row for s, _ in batch],
                                     [s.prompt_ids[s.num_cached:s.num_cached + n] for s, n in batch],
                                     [s.num_cached for s, _ in batch])
        for seq, n in batch:
            seq.num_cached += n
        done = [i for i, (seq, _) in enumerate(batch) if seq.prefill_remaining == 0]
        return [batch[i][0] for i in done], logits[done]

    def _decode(self) -> tuple[list[Sequence], torch.Tensor | None]:
        """One token for every decoding row; the batch spans rows 0..highest, idle rows masked out."""
        decoding = sorted((s for s in self.running.values() if s.status is Status.DECODE), key=lambda s: s.row)
        if not decoding:
            return [], None
        width = max(s.row for s in decoding) + 1
        dev = self.runner.device
        tokens = torch.zeros(width, dtype=torch.long, device=dev)
        positions = torch.zeros(width, dtype=torch.long, device=dev)
        active = torch.zeros(width, dtype=torch.bool, device=dev)
        rows = torch.tensor([s.row for s in decoding], device=dev)
        tokens[rows] = torch.tensor([s.last_token for s in decoding], device=dev)
        positions[rows] = torch.tensor([s.num_tokens - 1 for s in decoding], device=dev)
        active[rows] = True
        logits = self.runner.decode(tokens, positions, active)
        if len(decoding) < width:  # else rows are 0..width-1 in order: no copy of the logits
            logits = logits[rows]
        for s in decoding:
            s.num_cached += 1
        return decoding, logits

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        p = self.params
        rows = torch.tensor([s.row for s in seqs], device=logits.device)
        penalised = any(s.params.presence_penalty or s.params.frequency_penalty or s.params.repetition_penalty != 1.0
                        for s in seqs)
        if penalised:
            logits = apply_penalties(logits, rows, p)
        early = [s for s in seqs if s.num_output < s.params.min_tokens]
        if early:  # no end or stop token before min_tokens
            blocked = sorted(self.eos_ids.union(*(s.params.stop_token_ids for s in early)))
            masked = torch.tensor([s.num_output < s.params.min_tokens for s in seqs], device=logits.device)
            logits = mask_tokens(logits, masked, torch.tensor(blocked, device=logits.device))
        steps = torch.tensor([s.num_output for s in seqs], device=logits.device)
        min_p = p.min_p[rows] if any(s.params.min_p for s in seqs) else None
        tokens = sample(logits, p.temperature[rows], p.top_k[rows], p.top_p[rows], p.seed[rows], steps, min_p)
        if penalised:  # the counts only penalties read; a row's counts start afresh with its request
            p.record(rows, tokens)
        return tokens.tolist()

    def _postprocess(self, seqs: list[Sequence], tokens: list[int], logits: torch.Tensor) -> list[TokenEvent]:
        """Detokenize, match stops and gather log-probs per row. An exception here fails only the rows involved."""
        events = []
        want_logprobs = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        logprobs, logprob_error = {}, None
        try:
            logprobs = self._logprobs(logits, want_logprobs, tokens, seqs) if want_logprobs else {}
        except Exception as exc:
            log.exception("log-probs failed")
            logprob_error = exc
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            try:
                if logprob_error is not None and i in want_logprobs:
                    raise logprob_error
                events.extend(self._advance(seq, token, logprobs.get(i)))
            except Exception as exc:
                log.exception("post-processing failed for request %s", seq.session_id)
                events.append(self._fail(seq, f"engine error: {exc}"))
        return events

    def _advance(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> list[TokenEvent]:
        if seq.session_id in self._faulty:
            raise RuntimeError("injected post-processing fault (TEST_FAULT_TEXT)")
        if seq.status is Status.PREFILL:
            seq.status = Status.DECODE
        text = seq.append(token, self.eos_ids, self.context_length)
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        seq.pending_ids.append(token)
        events = [self._event(seq, text)] if text or seq.is_finished else []
        if seq.is_finished:
            self.sessions.pop(seq.session_id, None)
            self._release(seq)
        return events

    def _event(self, seq: Sequence, text: str, error: str | None = None) -> TokenEvent:
        event = TokenEvent(session_id=seq.session_id, text=text, token_ids=tuple(seq.pending_ids),
                           logprobs=tuple(seq.pending_logprobs), finish_reason=seq.finish_reason,
                           prompt_tokens=seq.num_prompt, completion_tokens=seq.num_output, error=error,
                           cached_tokens=seq.num_reused)
        seq.pending_ids.clear()
        seq.pending_logprobs.clear()
        return event

    def _logprobs(self, logits: torch.Tensor, idx: list[int], tokens: list[int],
                  seqs: list[Sequence]) -> dict[int, TokenLogprob]:
        lp = torch.log_softmax(logits[idx].float(), dim=-1)
        top_n = max(seqs[i].params.logprobs for i in idx)
        top_v, top_i = lp.topk(max(top_n, 1), dim=-1)
        out = {}
        for j, i in enumerate(idx):
            n = seqs[i].params.logprobs
            top = tuple((self.tokenizer.decode([t]), v) for t, v in zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()))
            out[i] = TokenLogprob(self.tokenizer.decode([tokens[i]]), float(lp[j, tokens[i]]), top)
        return out

    def _release(self, seq: Sequence, cache_valid: bool = True) -> None:
        if seq.row is not None and self.running.get(seq.row) is seq:
            del self.running[seq.row]
            if self.prefixes is not None:
                self.prefixes.hold(seq.row, seq.all_ids[:seq.num_cached] if cache_valid else [])
            self.rows.free(seq.row)
        seq.row = None

    def _fail(self, seq: Sequence, message: str, cache_valid: bool = True) -> TokenEvent:
        seq.finish(FinishReason.ERROR)
        self.sessions.pop(seq.session_id, None)
        self._faulty.discard(seq.session_id)
        self._release(seq, cache_valid)
        return self._event(seq, "", error=message)

    def _fail_running(self, message: str) -> list[TokenEvent]:
        """After a failed forward: no row's cache can be trusted past what it held before, so none is kept."""
        return [self._fail(seq, message, cache_valid=False) for seq in list(self.running.values())]
