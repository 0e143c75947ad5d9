"""The engine: each step the scheduler plans, the rows draft what they can (speculative.py), the runner computes
the logits, the sampler draws every row's next token (a drafting row's at each drafted position), and the engine
emits them as text (``Engine.step``: schedule, draft, run, sample, emit)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Protocol

import torch

from .adapters import Adapters
from .constrain import Constraints
from .messages import (
    AdapterReply,
    EmbedRequest,
    EngineStats,
    ErrorKind,
    FinishReason,
    GenerateRequest,
    LoadAdapter,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    UnloadAdapter,
    packed_vector,
    refusal,
    step_rows_bucket,
)
from .prompt_cache import PromptCache
from .sampler import Sampler
from .scheduler import Scheduler, Step
from .sequence import Sequence, Status
from .speculative import ModelDrafter, RowDrafts, SpecConfig, StepCosts, kept

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger(__name__)


# the next decode step launched from sampled tokens still on the device: (rows, tokens, positions) -> what reads
# the tokens back (CUDA graphs: cuda_graphs.DecodeGraphs.decode_ahead)
LaunchAhead = Callable[[list[int], torch.Tensor, list[int]], Callable[[], list[int]]]


class Runner(Protocol):
    """What the engine asks of a runner (model_runner.ModelRunner, parallel.GroupRunner, mock.MockRunner)."""

    device: torch.device
    vocab_size: int

    def prefill(self, rows: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor: ...

    def decode(self, rows: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor: ...

    def copy_prefix(self, src: int, dst: int, length: int) -> None: ...

    def verify(self, rows: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor: ...

    def hidden(self, row: int, ids: list[int], start: int = 0) -> torch.Tensor: ...  # token vectors (--embedding)

    def snapshot(self, row: int, length: int) -> list[torch.Tensor]: ...  # a row's cache, for the prompt cache

    def restore(self, row: int, tensors: list[torch.Tensor]) -> None: ...

    def score(self, row: int, ids: list[int], start: int = 0) -> torch.Tensor: ...  # every position's logits

    def holds(self, cached: int, length: int) -> bool:
        """Whether a row that wrote cached positions still holds a prefix of length (a sliding window's ring
        keeps only its last positions)."""
        ...

    @property
    def decode_ahead(self) -> LaunchAhead | None:
        """The launch of the next decode step ahead of reading the tokens (None: this runner has none)."""
        ...


class Detokenizer(Protocol):
    def decode(self, ids: Seq[int]) -> str: ...


# what a client sees when its grammar cannot be built for this model's vocabulary (llguidance's reason follows)
GRAMMAR_ERROR = "grammar error: the request's grammar could not be built for this model"
# requests of one team (the proxy's; requests without a team are the operator's, not bounded) whose grammar may
# be compiling at once; more get a BUSY error at once (a 429). Small schemas compile in milliseconds, so only
# a flood of large new ones reaches it; the queue takes the teams in turn either way (constrain.FairQueue)
MAX_COMPILING_PER_TEAM = 8
COMPILING_BUSY = f"too many grammars being compiled for this team (at most {MAX_COMPILING_PER_TEAM} at once); retry"
# how long an engine with nothing else to do waits for a grammar being compiled before it looks at its inbox
COMPILE_POLL_S = 0.005

# what a client sees when a step fails: the exception's text (paths, shapes, internals) stays in the log
ENGINE_ERROR = "engine error: this request failed on the server (its log has the details, under the request id)"


class Engine:
    """Each step: the scheduler admits and plans, the runner computes logits, the sampler draws every row's token,
    the engine turns tokens into events."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Detokenizer,
        rows: int,
        context_length: int,
        prefill_chunk: int,
        eos_ids: frozenset[int],
        prefix_cache: bool = True,
        constraints: Constraints | None = None,
        spec: SpecConfig | None = None,
        prompt_cache: PromptCache | None = None,
        drafter: ModelDrafter | None = None,
        pooling: str | None = None,
        adapters: Adapters | None = None,
        kernels=None,
    ):
        """kernels: the CPU kernels, for the sampler's draw (None: torch's)."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(rows, prefill_chunk, prefix_cache, context_length, runner.holds, prompt_cache)
        self.prompt_cache = self.scheduler.prompt_cache  # the caches beyond the rows (None: off)
        self.sampler = Sampler(rows, runner.vocab_size, runner.device, eos_ids, tokenizer.decode, constraints, kernels)
        self.context_length = context_length
        self.eos_ids = eos_ids
        self.sessions: dict[str, list[Sequence]] = {}  # a request's choices not yet ended (n: SamplingParams.n)
        self.constraints = constraints  # None: requests with a grammar fail (the mock has no real vocabulary)
        # requests (a choice each: Sequence.key) waiting for their grammar's matcher (None: no grammar support)
        self.compiling: dict[tuple[str, int], tuple[Sequence, Future[LLMatcher] | None]] = {}
        self.refused: list[TokenEvent] = []  # requests ended before they were queued, for the next step to emit
        # decode steps and their seconds by step_rows_bucket (EngineStats.decode_steps)
        buckets = step_rows_bucket(rows) + 1
        self.decode_steps, self.decode_seconds = [0] * buckets, [0.0] * buckets
        self.launch_ahead = runner.decode_ahead
        self.spec = spec  # speculative decoding (None: off; the runner must verify drafts)
        self.costs = StepCosts()  # what plain steps and drafted tokens cost, measured (how much to draft)
        self.drafter = drafter if spec is not None else None  # a draft model's (None: prompt lookup)
        # --embedding: inputs' token vectors pooled (last | mean) instead of text; None: the model generates
        self.pooling = pooling
        self.embedded: list[TokenEvent] = []  # the embeddings finished in a step, for its events
        self.spec_drafted = self.spec_accepted = self.spec_steps = 0
        self.adapters = adapters  # LoRA adapters by name (None: the runner takes none)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.compiling or self.refused)

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats(
            decode_steps=tuple(self.decode_steps),
            decode_seconds=tuple(self.decode_seconds),
            spec_drafted_tokens=self.spec_drafted,
            spec_accepted_tokens=self.spec_accepted,
            spec_steps=self.spec_steps,
        )

    def add(self, request: GenerateRequest) -> None:
        """Queue a request (see ``_queue``); with --embedding the model embeds only: a clear error."""
        if self.pooling is not None:
            self.refused.append(refusal(request.session_id, "this server embeds (--embedding): use /v1/embeddings"))
            return
        self._queue(request)

    def _queue(self, request: GenerateRequest) -> None:
        """Queue a request. With n choices, choice 0 goes first; the others are held until its prompt is cached
        (``_fork``), then take rows copying that prefix from its row: one prefill for all n."""
        try:
            adapters, tag = self._resolve_adapters(request.params.lora)
        except ValueError as exc:
            self.refused.append(refusal(request.session_id, str(exc)))
            return
        seqs = [Sequence(request, self.tokenizer.decode, i, adapters, tag) for i in range(max(1, request.params.n))]
        self.scheduler.arrive(seqs)
        self.sessions[request.session_id] = seqs
        first = seqs[0]
        first.forks = seqs[1:]
        if request.params.grammar is not None and self.constraints is not None:
            if request.team is not None and self._compiling_for(request.team) >= MAX_COMPILING_PER_TEAM:
                self.refused.append(self._fail(first, COMPILING_BUSY, kind=ErrorKind.BUSY))
                return
            for fork in first.forks:  # built while the prompt is computed
                fork.future = self.constraints.compile(request.params.grammar, request.team)
        self._enqueue(first)

    def _resolve_adapters(self, lora: tuple[tuple[str, float], ...]) -> tuple[tuple[tuple[int, float], ...], str]:
        """A request's LoRA adapters as (slot, scale) pairs and their namespace tag; ValueError naming one that is
        not loaded."""
        if not lora:
            return (), ""
        if self.adapters is None:
            raise ValueError(f"LoRA adapter {lora[0][0]!r} is not loaded (this engine takes no adapters)")
        return self.adapters.resolve(lora)

    def adapter_message(self, msg: LoadAdapter | UnloadAdapter) -> AdapterReply:
        """Load or unload an adapter between steps; the reply carries the result or the error, and the adapters
        requests may name now."""
        adapters = self.adapters
        if adapters is None:
            return AdapterReply(msg.request_id, error="this engine takes no LoRA adapters")
        try:
            if isinstance(msg, LoadAdapter):
                info = adapters.load(msg.name, msg.path)
                return AdapterReply(msg.request_id, adapters.infos, info=info)
            unloaded = adapters.unload(msg.name, self._adapter_slots())
            return AdapterReply(msg.request_id, adapters.infos, unloaded=unloaded)
        except Exception as exc:  # a bad file is the operator's error, never the engine's end
            log.warning("LoRA adapter %r: %s", msg.name, exc)
            return AdapterReply(msg.request_id, adapters.infos, error=str(exc))

    def _adapter_slots(self) -> set[int]:
        """The adapter slots of every sequence not ended (waiting, compiling, held or in a row)."""
        return {slot for seqs in self.sessions.values() for s in seqs for slot, _ in s.adapters}

    def embed(self, request: EmbedRequest) -> None:
        """With --embedding, each input a sequence whose prompt is computed in a row as any prompt is (sharing
        steps with the other rows), its tokens' vectors pooled, no token sampled (``_embedding``); without it,
        a generating model does not embed: the request ends with a clear error."""
        if self.pooling is None:
            why = "this server's model generates text; it does not embed (serve an embedding model's GGUF, or this one"
            self.refused.append(refusal(request.session_id, f"{why} with --embedding)"))
            return
        seqs = []
        for i, ids in enumerate(request.inputs):
            one = GenerateRequest(request.session_id, ids, SamplingParams(max_tokens=1), request.team)
            seq = Sequence(one, self.tokenizer.decode, i)
            seq.embeds, seq.normalize = True, request.normalize
            seqs.append(seq)
        self.scheduler.arrive(seqs)
        self.sessions[request.session_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def _pool(self, seq: Sequence, n: int) -> None:
        """An input to embed: the vectors of its next n tokens written into its row and pooled (a sum for mean,
        the last for last)."""
        vectors = self.runner.hidden(seq.held_row, seq.prompt_ids[seq.num_cached : seq.num_cached + n], seq.num_cached)
        part = vectors.float().sum(0) if self.pooling == "mean" else vectors[-1].float()
        seq.pooled = part if seq.pooled is None or self.pooling != "mean" else seq.pooled + part

    def _embedding(self, seq: Sequence) -> TokenEvent:
        """An input's prompt is computed: its pooled vector's event, and its row freed."""
        vector = seq.pooled
        if vector is None:
            raise RuntimeError("an input to embed was computed without its vectors")
        if self.pooling == "mean":
            vector = vector / seq.num_prompt
        if seq.normalize:
            vector = torch.nn.functional.normalize(vector.float(), dim=-1)
        seq.finish(FinishReason.STOP)
        event = TokenEvent(
            seq.session_id,
            "",
            finish_reason=FinishReason.STOP,
            prompt_tokens=seq.num_prompt,
            index=seq.index,
            embedding=packed_vector(vector),
        )
        self._forget(seq)
        self.scheduler.release(seq)
        return event

    def _compiling_for(self, team: str | None) -> int:
        """The team's requests whose grammar is still being built."""
        return len({s.session_id for s, f in self.compiling.values() if s.team == team and f and not f.done()})

    def _enqueue(self, seq: Sequence) -> None:
        grammar = seq.params.grammar
        if grammar is None:
            self.scheduler.add(seq, first=seq.index > 0)
        elif self.constraints is not None:  # the matcher is built off the loop; the row is taken once it is
            self.compiling[seq.key] = (seq, seq.future or self.constraints.compile(grammar, seq.team))
        else:
            self.compiling[seq.key] = (seq, None)

    def _fork(self, seq: Sequence) -> None:
        """Choice 0's prompt is cached: its held choices queue ahead of other requests, each to find the prompt
        in its row (the prefix cache) and copy it."""
        forks, seq.forks = seq.forks, []
        for fork in reversed(forks):  # each goes first: choice 1 ends up ahead
            self._enqueue(fork)

    def cancel(self, session_id: str) -> None:
        """End every choice of a request (held, compiling, waiting or in a row)."""
        for seq in self.sessions.pop(session_id, None) or ():
            if self.compiling.pop(seq.key, None) is None:
                self.scheduler.release(seq)
            seq.finish(FinishReason.CANCELLED)

    def _forget(self, seq: Sequence) -> None:
        seqs = self.sessions.get(seq.session_id)
        if seqs is not None and seq in seqs:
            seqs.remove(seq)
            if not seqs:
                del self.sessions[seq.session_id]

    def step(self) -> list[TokenEvent]:
        """Schedule, draft, run, sample, emit: one step of every row that has work (and the requests that ended
        before they ran: refused, or their grammar failed); then the slots of unloaded adapters whose last
        sequences ended are freed."""
        events = self._step()
        if self.adapters is not None and self.adapters.pending:
            self.adapters.sweep(self._adapter_slots())
        return events

    def _step(self) -> list[TokenEvent]:
        failed, self.refused = self.refused + self._compiled(), []
        self._admit()
        started = time.perf_counter()
        step = self.scheduler.schedule()
        if not step:
            return failed
        drafts = self._draft(step)
        try:
            if drafts:
                seqs, logits, offsets = self._verify(step, drafts)
            else:
                (seqs, logits), offsets = self._run(step), None
            if not seqs:  # only prompt chunks that did not finish (or inputs embedded): nothing to sample
                return self._with_embedded(failed)
            tokens = self._sample(seqs, logits, offsets, ahead=not step.prefill and not drafts)
        except Exception:  # a failed forward must not take the process (and every stream) down
            log.exception("engine step failed")
            return self._with_embedded(failed) + self._fail_running(ENGINE_ERROR)
        events = self._emit(seqs, tokens, logits, drafts)
        if not step.prefill:  # a decode step alone: its time by the rows it decoded
            bucket, seconds = step_rows_bucket(len(step.decode)), time.perf_counter() - started
            self.decode_steps[bucket] += 1
            self.decode_seconds[bucket] += seconds
            self.costs.record(len(step.decode), sum(map(len, drafts.values())), seconds)
        return self._with_embedded(failed + events)

    def _with_embedded(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """The step's events with the embeddings it finished (``_run``)."""
        out, self.embedded = events + self.embedded, []
        return out

    def _compiled(self) -> list[TokenEvent]:
        """Requests whose matcher is ready go to the scheduler; those whose grammar failed end with an error.
        With nothing else to run, wait a moment for one."""
        if not self.compiling:
            return []
        if not self.scheduler.has_work:
            wait([f for _, f in self.compiling.values() if f is not None], COMPILE_POLL_S, FIRST_COMPLETED)
        events = []
        for key, (seq, future) in list(self.compiling.items()):
            if future is not None and not future.done():
                continue
            del self.compiling[key]
            try:
                if future is None:
                    raise ValueError("this engine has no grammar support (the mock backend)")
                seq.matcher = future.result()
            except Exception as exc:
                log.warning("grammar of request %s could not be built: %s", seq.session_id, exc)
                reason = str(exc).split("\n")[0][:300]
                events.append(self._fail(seq, f"{GRAMMAR_ERROR}: {reason}", kind=ErrorKind.INVALID))
                continue
            self.scheduler.add(seq, first=seq.index > 0)
        return events

    def _admit(self) -> None:
        """Admitted requests take their rows: what a row held is kept in the prompt cache before it is written
        over, and a reused prefix is copied from another row or restored from the prompt cache."""
        for admission in self.scheduler.admit():
            seq = admission.seq
            self.sampler.admit(seq)
            if self.adapters is not None:  # the row's forwards apply the sequence's adapters (none: the base's)
                self.adapters.assign(seq.held_row, seq.adapters)
            if admission.evict is not None and self.prompt_cache is not None:
                owner, tokens = admission.evict
                try:
                    self.prompt_cache.save(owner, tokens, self.runner.snapshot(seq.held_row, len(tokens)))
                except Exception:  # (only a cache: the row is written over all the same)
                    log.exception("keeping a row's cache in the prompt cache failed")
            try:
                if admission.restore is not None and self.prompt_cache is not None:
                    tensors = self.prompt_cache.load(admission.restore)
                    if tensors is None:
                        raise ValueError("the prompt cache's entry could not be read")
                    self.runner.restore(seq.held_row, tensors)
                elif admission.copy_from is not None:
                    self.runner.copy_prefix(admission.copy_from, seq.held_row, admission.length)
            except Exception:  # the prompt is then computed in full
                log.exception("copying a cached prefix failed")
                self.scheduler.forget_prefix(seq)

    def close(self) -> None:
        """At shutdown, with the prompt cache on disk: every row's cache saved there too, so a restart finds it."""
        cache = self.prompt_cache
        if cache is None or cache.folder is None or self.scheduler.prefixes is None:
            return
        held = {row: self.scheduler.prefixes.held(row) for row in range(self.scheduler.rows.num_rows)}
        held.update({row: (s.namespace, s.all_ids[: s.num_cached]) for row, s in self.scheduler.running.items()})
        for row, (owner, tokens) in held.items():
            if cache.needs(owner, tokens):
                try:
                    cache.save(owner, tokens, self.runner.snapshot(row, len(tokens)))
                except Exception:
                    log.exception("saving row %d's cache at shutdown failed", row)
        cache.flush()

    def _run(self, step: Step) -> tuple[list[Sequence], torch.Tensor]:
        """Up to one chunk of prompt tokens and every decoding row: one runner call each."""
        prefill = decode = None
        sampled = [(s, n) for s, n in step.prefill if not s.embeds]  # (inputs to embed are pooled, not sampled)
        for s, n in step.prefill:
            if s.embeds:
                self._pool(s, n)
        if sampled:
            prefill = self._prefill(sampled)
        if step.decode:
            decode = self.runner.decode(
                [s.held_row for s in step.decode],
                [s.last_token for s in step.decode],
                [s.num_tokens - 1 for s in step.decode],
            )
        finished = [step.prefill[i][0] for i in self.scheduler.computed(step)]
        self.embedded += [self._embedding(s) for s in finished if s.embeds]  # their vectors, no token
        row_of = {id(s): j for j, (s, _) in enumerate(sampled)}
        done = [row_of[id(s)] for s in finished if not s.embeds]
        seqs = [sampled[j][0] for j in done] + step.decode
        parts = ([prefill[done]] if prefill is not None and done else []) + ([decode] if decode is not None else [])
        if not parts:
            return [], torch.empty(0)
        return seqs, parts[0] if len(parts) == 1 else torch.cat(parts)

    def _draft(self, step: Step) -> dict[int, list[int]]:
        """Each decoding row's draft (by row) where speculation pays: in a step of decoding rows alone, no more of
        them than ``SpecConfig.max_rows``, each row's prompt-lookup candidates cut to what the measured costs say
        raises the step's tokens per second (``StepCosts.choose``; none: a plain step)."""
        spec = self.spec
        if spec is None or step.prefill or not step.decode or len(step.decode) > spec.max_rows:
            return {}
        candidates = {}
        for seq in step.decode:
            limit = min(spec.draft_max, self.context_length - seq.num_tokens - 1)
            if seq.params.max_tokens is not None:
                limit = min(limit, seq.params.max_tokens - seq.num_output - 1)
            if limit < 1 or not seq.may_draft:
                continue
            if seq.drafts is None:
                seq.drafts = RowDrafts(spec)
            # a draft model's tokens are written once their number is chosen (placeholders until then)
            draft = (
                [0] * limit if self.drafter is not None else seq.drafts.propose(seq.prompt_ids, seq.output_ids, limit)
            )
            if draft:
                candidates[seq.held_row] = (draft, seq.drafts.acceptance)
        drafts = self.costs.choose(len(step.decode), candidates, spec.max_tokens)
        if self.drafter is not None and drafts:
            drafts = self.drafter.draft(step.decode, {row: len(d) for row, d in drafts.items()})
        for seq in step.decode:
            if seq.drafts is not None and seq.held_row not in drafts:
                seq.drafts.idle()
        return drafts

    def _verify(self, step: Step, drafts: dict[int, list[int]]) -> tuple[list[Sequence], torch.Tensor, list[int]]:
        """Every decoding row's last token and its draft (none for some) in one forward: the logits after each of
        them, a sequence once per position (``offsets``: which of its next tokens each position draws)."""
        rows = [s.held_row for s in step.decode]
        chunks = [[s.last_token, *drafts.get(s.held_row, ())] for s in step.decode]
        logits = self.runner.verify(rows, chunks, [s.num_tokens - 1 for s in step.decode])
        self.scheduler.computed(step)  # (each row's last token; the drafts' positions count once kept: _emit)
        self.spec_steps += 1
        seqs = [s for s, chunk in zip(step.decode, chunks) for _ in chunk]
        return seqs, logits, [j for chunk in chunks for j in range(len(chunk))]

    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Each chunk's last logits [len(chunks), V]: one runner call for them all, except a request that wants
        its prompt's log-probs, whose chunk is scored on its own (every position's logits, ``_score_prompt``)."""
        plain = [(s, n) for s, n in chunks if not s.scores_prompt]
        logits = None
        if plain:
            logits = self.runner.prefill(
                [s.held_row for s, _ in plain],
                [s.prompt_ids[s.num_cached : s.num_cached + n] for s, n in plain],
                [s.num_cached for s, _ in plain],
            )
            if len(plain) == len(chunks):
                return logits
        plain_rows = iter(logits if logits is not None else ())  # the plain chunks' rows, in order
        rows = []
        for s, n in chunks:
            if s.scores_prompt:
                every = self.runner.score(s.held_row, s.prompt_ids[s.num_cached : s.num_cached + n], s.num_cached)
                self.sampler.score_prompt(s, every, s.num_cached)
                rows.append(every[-1])
            else:
                rows.append(next(plain_rows))
        return torch.stack(rows)

    def _sample(
        self, seqs: list[Sequence], logits: torch.Tensor, offsets: list[int] | None = None, ahead: bool = False
    ) -> list[int]:
        """Each row's next token (the sampler's; a drafting row's at each of its positions, ``offsets``); ahead
        (a step of decoding rows alone): the next step may be launched from them before they are read back
        (_launch_ahead)."""
        tokens = self.sampler.sample(seqs, logits, offsets)
        read = self._launch_ahead(seqs, tokens) if ahead else None
        return read() if read is not None else tokens.tolist()

    def _launch_ahead(self, seqs: list[Sequence], tokens: torch.Tensor) -> Callable[[], list[int]] | None:
        """Where the runner can (CUDA graphs: ModelRunner.decode_ahead), launch the next decode step of these rows
        from the tokens just sampled, before the host reads them, so the GPU computes it while this step's tokens
        become text; the runner uses it if the next step decodes the same rows from these tokens, else computes
        that step afresh. Not where this step's logits are still to be read (log-probs), where a row would pass
        the context, or where every row ends with this token. Returns what reads the tokens, or None."""
        launch = self.launch_ahead
        if launch is None or any(s.params.logprobs is not None or s.adapters for s in seqs):
            return None  # (a step with adapter rows stages their adapters first: not launched ahead)
        positions = [s.num_tokens for s in seqs]  # each row's next position (its last token's + 1)
        if max(positions) >= self.context_length or all(s.at_length(self.context_length, ahead=1) for s in seqs):
            return None
        return launch([s.held_row for s in seqs], tokens, positions)

    def _emit(
        self, seqs: list[Sequence], tokens: list[int], logits: torch.Tensor, drafts: dict[int, list[int]]
    ) -> list[TokenEvent]:
        """Detokenize, match stops and gather log-probs per row; a drafting row's samples up to and including the
        first that is not its draft's token (``speculative.kept``). An exception here fails only the rows
        involved."""
        events = []
        logprobs: dict[int, TokenLogprob] = {}
        logprob_error = None
        try:
            logprobs = self.sampler.logprobs(seqs, logits, tokens)
        except Exception as exc:
            log.exception("log-probs failed")
            logprob_error = exc
        i = 0
        while i < len(seqs):
            seq = seqs[i]
            draft = drafts.get(seq.held_row, []) if drafts and seq.row is not None else []
            sampled = tokens[i : i + len(draft) + 1]
            n = kept(draft, sampled)
            try:
                if logprob_error is not None and seq.params.logprobs is not None:
                    raise logprob_error
                for j, token in enumerate(sampled[: n + 1]):
                    if seq.is_finished:
                        break
                    if j:  # the drafted token before it is kept: its position's keys and values hold
                        seq.num_cached += 1
                    events.extend(self._advance(seq, token, logprobs.get(i + j)))
                if draft and seq.drafts is not None:
                    seq.drafts.record(len(draft), n)
                    if self.drafter is not None:
                        self.drafter.kept(seq, len(draft), n)
                    self.spec_drafted += len(draft)
                    self.spec_accepted += n
            except Exception:
                log.exception("post-processing failed for request %s", seq.session_id)
                events.append(self._fail(seq, ENGINE_ERROR))
            i += len(draft) + 1
        return events

    def _advance(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> list[TokenEvent]:
        if seq.status is Status.PREFILL:
            seq.status = Status.DECODE
            if seq.forks:
                self._fork(seq)
        matcher = seq.matcher if seq.grammar_active else None  # (a thought is not constrained)
        if matcher is not None and not matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {matcher.get_error()}")
        text = seq.append(token, self.eos_ids, self.context_length)
        if matcher is not None and not seq.is_finished and matcher.is_stopped():
            text += seq.finish(FinishReason.STOP)  # the grammar is complete: nothing more may follow
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        seq.pending_ids.append(token)
        # the prompt's log-probs go out with the prefill's event, text or not (before any other choice's)
        report = text or seq.pending_reasoning or seq.is_finished or seq.prompt_logprobs is not None
        events = [self._event(seq, text)] if report else []
        if seq.is_finished:
            self._forget(seq)
            self.scheduler.release(seq)
        return events

    def _event(self, seq: Sequence, text: str, error: str | None = None, kind: ErrorKind | None = None) -> TokenEvent:
        event = TokenEvent(
            session_id=seq.session_id,
            text=text,
            token_ids=tuple(seq.pending_ids),
            logprobs=tuple(seq.pending_logprobs),
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt,
            completion_tokens=seq.num_output,
            error=error,
            error_kind=kind,
            cached_tokens=seq.num_reused,
            index=seq.index,
            prompt_logprobs=None if seq.prompt_logprobs is None else tuple(seq.prompt_logprobs),
            reasoning=seq.pending_reasoning,
            reasoning_tokens=seq.reasoning_tokens,
        )
        seq.pending_reasoning = ""
        seq.prompt_logprobs = None  # sent once, with the first event
        seq.pending_ids.clear()
        seq.pending_logprobs.clear()
        return event

    def _fail(
        self, seq: Sequence, message: str, cache_valid: bool = True, kind: ErrorKind = ErrorKind.FAILED
    ) -> TokenEvent:
        self.scheduler.release(seq, cache_valid)
        seq.finish(FinishReason.ERROR)
        self._forget(seq)
        for fork in seq.forks:  # choices still held end with it (its error ends the request's every stream)
            fork.finish(FinishReason.ERROR)
            self._forget(fork)
        seq.forks = []
        return self._event(seq, "", error=message, kind=kind)

    def _fail_running(self, message: str) -> list[TokenEvent]:
        """After a failed forward: no row's cache can be trusted past what it held before, so none is kept."""
        return [self._fail(seq, message, cache_valid=False) for seq in list(self.scheduler.running.values())]
