"""The serving layer under every API (after vLLM's ``OpenAIServing``): readiness and the model check,
the drain refusal and the team quota, preparation (``prepare``: the prompt's tokens, max-token defaults, the
context fit), submission, and the event stream of one request.

Each dialect (``dialects/``) is a parser (request body into the engine's ``SamplingParams``) and a formatter
(events into its wire format); everything between the two lives here, once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from flask import g, has_request_context, request

from lifecycle.drain import RETRY_AFTER, Drain
from lifecycle.quota import TeamLimits

from ..config import ServerConfig
from ..engine.client import EngineClient
from ..engine.messages import EngineReady, FinishReason, SamplingParams, TokenEvent
from ..engine.preflight import Estimate
from ..model.tokenizer import Tokenizer
from ..request.generation import Generation, all_events, collect, collect_choices
from ..request.prepare import (
    DEFAULT_MAX_TOKENS,
    Prompt,
    check_chars,
    check_prompt_size,
    encode,
    engine_params,
    fit_inputs,
)
from ..request.reasoning import Thinking, with_reasoning
from ..request_errors import ModelNotFound, RateLimited, RequestError, Unavailable
from .models import ModelPool, ModelSlot
from .streaming import first_event, session_events

RESERVATION_KEY = "inference_api.reservation"  # environ key: the request's quota Reservation, settled by app.py
# flask.g: the request's model, its engine, and the adapter its model name names (check_model)
SLOT_KEY, CLIENT_KEY, ADAPTER_KEY = "model_slot", "model_client", "model_adapter"


@dataclass
class Run:
    """One submitted request whose first event has arrived (so early failures still get a status code)."""

    prompt_tokens: int
    first: TokenEvent | None
    rest: Iterator[TokenEvent]
    n: int = 1  # choices: the events of all n come interleaved, each tagged with its index
    prompt_ids: tuple[int, ...] = ()

    def events(self) -> Iterator[TokenEvent]:
        """Every event, the first included; an ``ERROR`` event is left to the formatter to render."""
        return all_events(self.first, self.rest)

    def collect(self) -> Generation:
        """The whole generation (Unavailable if the engine fails on the way)."""
        return collect(self.first, self.rest)

    def collect_choices(self) -> list[Generation]:
        """Each of the n choices' whole generation."""
        return collect_choices(self.first, self.rest, self.n)


class Serving:
    def __init__(
        self,
        models: ModelPool,
        config: ServerConfig,
        drain: Drain | None = None,
        preflight: Estimate | None = None,
        limits: TeamLimits | None = None,
    ):
        self.models = models  # every model served; a request's check_model picks its own (web/models.py)
        self.limits = limits  # the teams' token quota (lifecycle.quota), reserved before each submission
        self.config = config
        self.drain = drain  # while it is active, new generation requests get a 503 in their API's shape
        self.preflight = preflight  # the pre-flight memory estimate, shown by /health

    @property
    def draining(self) -> bool:
        return self.drain is not None and self.drain.active

    # the request's model: the one its check_model named, else the first
    @property
    def slot(self) -> ModelSlot:
        return (g.get(SLOT_KEY) if has_request_context() else None) or self.models.default

    @property
    def client(self) -> EngineClient:
        """The engine of the request's model (loaded by check_model), or the first model's."""
        client = g.get(CLIENT_KEY) if has_request_context() else None
        return client if client is not None else self.models.acquire(self.models.default)

    def check_model(self, name: str, placeholders: bool = False) -> None:
        """Make ``name`` the request's model, loaded if it is not (``ModelPool.acquire``), and the LoRA adapter
        it names, if any (``base:adapter`` or an adapter's own name): ModelNotFound unless the server serves it
        (or, with ``placeholders``, for a placeholder name: the first model)."""
        slot, adapter = self.models.resolve(name, placeholders)
        client = self.models.acquire(slot)
        if adapter is not None and adapter not in (a.name for a in client.adapters):
            held = ", ".join(repr(a.name) for a in client.adapters) or "none"
            raise ModelNotFound(f"model {slot.name!r} has no LoRA adapter {adapter!r} (it has {held})", "model")
        g.setdefault(SLOT_KEY, slot)
        g.setdefault(CLIENT_KEY, client)
        if adapter is not None:
            g.setdefault(ADAPTER_KEY, (name, adapter))

    def adapters(self, refs: Sequence[tuple[int | str, float]] = ()) -> tuple[tuple[str, float], ...]:
        """The request's LoRA adapters as the engine takes them, (name, scale): the one its model name names, at
        scale 1, and llama-server's per-request ``lora`` list (each adapter by its id, the place in the model's
        list of adapters, or by its name)."""
        named = g.get(ADAPTER_KEY) if has_request_context() else None
        held = [a.name for a in self.client.adapters]
        out = [(named[1], 1.0)] if named else []
        for i, (ref, scale) in enumerate(refs):
            if isinstance(ref, int):
                if ref >= len(held):
                    raise RequestError(
                        f"lora[{i}].id {ref} is not one of this model's adapters (ids 0 to {len(held) - 1})"
                        if held
                        else f"lora[{i}]: this model has no LoRA adapters",
                        "lora",
                    )
                ref = held[ref]
            elif ref not in held:
                raise RequestError(f"lora[{i}].name {ref!r} is not one of this model's adapters {held}", "lora")
            out.append((ref, scale))
        return tuple(out)

    # readiness and the model
    def ready(self) -> EngineReady:
        return self.client.check_ready()

    @property
    def tokenizer(self) -> Tokenizer:
        self.ready()
        tokenizer = self.client.tokenizer
        if tokenizer is None:  # (the client loads it before it reports the engine ready)
            raise Unavailable("model is loading, try again shortly", retry_after=5)
        return tokenizer

    @property
    def model_name(self) -> str:
        """The request's model's name, as requests name it (an adapter's as the request named it)."""
        named = g.get(ADAPTER_KEY) if has_request_context() else None
        if named is not None:
            return str(named[0])
        return self.ready().model_name if self.slot.default else self.slot.name

    def tokenizable(self, text: str, name: str) -> str:
        """Text to tokenize, within the character cap (``prepare.char_limit``): more can never fit a request."""
        check_chars(len(text), self.ready().context_length, name, name)
        return text

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's tokens, once its size is known to be within the character cap."""
        check_prompt_size(prompt, self.ready().context_length)
        return encode(self.tokenizer, prompt)

    def check_quota(self, team: str | None, prompt_tokens: int, params: SamplingParams) -> None:
        """Reserve the request's most possible cost against its team's token quota (``n x max_tokens`` generated,
        the prompt at its weight), kept in the environ for the answer's end to settle (app.py); RateLimited while
        the team's rate (what its answers cost in the last minute, running ones at their reservation) is at or
        over the quota."""
        if self.limits is None:
            return
        most = params.max_tokens if params.max_tokens is not None else self.ready().context_length  # (prepared: set)
        self._reserve(team, params.n * most, prompt_tokens)

    def _reserve(self, team: str | None, generated: int, prompt_tokens: int) -> None:
        """check_quota's reservation of a cost (an embedding request's: its inputs alone)."""
        if self.limits is None:
            return
        reserved = self.limits.reserve(team, self.limits.cost(generated, prompt_tokens))
        if isinstance(reserved, int):
            raise RateLimited(
                f"team {team!r} has used its quota of {self.limits.tokens_per_minute} tokens in the last minute "
                f"(running requests count at n x max_tokens until they end); retry in {reserved} s",
                retry_after=reserved,
            )
        request.environ[RESERVATION_KEY] = reserved

    def _refuse_while_draining(self) -> None:
        if self.draining:
            raise Unavailable(
                "server is shutting down; retry shortly (another instance takes over)", retry_after=RETRY_AFTER
            )

    # embeddings and scores (an embedding model's or a reranker's engine)
    def embed(
        self,
        texts: Sequence[str] | None,
        ids: Sequence[Sequence[int]] | None,
        normalize: bool,
        truncate: bool,
        field: str,
    ) -> tuple[list[np.ndarray], int]:
        """Each input's vector, and the tokens they took: texts tokenized (or token ids as given), each within
        the model's context (cut to it with ``truncate``, else a 400)."""
        if self.ready().task != "embed":
            raise RequestError(f"this server's model ({self.model_name}) does not embed: {self._task()}", field)
        if texts is not None:
            inputs = [self.tokenizer.encode(self.tokenizable(t, field)) for t in texts]
        else:
            inputs = [list(i) for i in ids or ()]
        return self._submit_inputs(inputs, normalize, truncate, field)

    def score(self, query: str, documents: Sequence[str], truncate: bool) -> tuple[list[float], int]:
        """A reranker's score of each (query, document) pair, and the tokens they took."""
        if self.ready().task != "score":
            raise RequestError(f"this server's model ({self.model_name}) is not a reranker: {self._task()}", "query")
        tok = self.tokenizer
        pairs = [tok.encode_pair(self.tokenizable(query, "query"), self.tokenizable(d, "documents")) for d in documents]
        scores, tokens = self._submit_inputs(pairs, False, truncate, "documents")
        return [float(s[0]) for s in scores], tokens

    def _task(self) -> str:
        return {
            "generate": "it generates text (serve an embedding model's or a reranker's GGUF for these routes)",
            "embed": "it is an embedding model (/v1/embeddings, /embed)",
            "score": "it is a reranker (/rerank, /v1/rerank)",
        }[self.ready().task]

    def _submit_inputs(
        self, inputs: list[list[int]], normalize: bool, truncate: bool, field: str
    ) -> tuple[list[np.ndarray], int]:
        inputs = fit_inputs(inputs, self.ready().context_length, truncate, field)
        self._refuse_while_draining()
        tokens = sum(len(i) for i in inputs)
        team = request.headers.get("X-Team-Id")
        self._reserve(team, 0, tokens)
        session = self.client.embed(inputs, normalize, team)
        events = session_events(self.client, session, request.environ)
        vectors: list[np.ndarray] = [np.empty(0, np.float32) for _ in inputs]
        for event in all_events(first_event(events), events):
            if event.finish_reason is FinishReason.ERROR:
                raise Unavailable(event.error or "embedding failed", retry_after=5)
            vectors[event.index] = event.vector
        return vectors, tokens

    # submission
    def start(
        self,
        prompt: Prompt,
        params: SamplingParams,
        default_max: int = DEFAULT_MAX_TOKENS,
        field: str = "max_tokens",
        thinking: Thinking | None = None,
        lora: Sequence[tuple[int | str, float]] = (),
    ) -> Run:
        """Encode the prompt, refuse while draining, prepare the engine's parameters (``prepare.engine_params``:
        max_tokens filled in, the context fit; a chat's thought: ``reasoning.with_reasoning``, with the request's
        ``thinking``), reserve its cost in the team's quota, submit (refused past the server's or the team's
        places), and wait for the first event."""
        prompt_ids = self.encode(prompt)
        self._refuse_while_draining()
        params = engine_params(prompt_ids, params, self.ready().context_length, default_max=default_max, field=field)
        adapters = self.adapters(lora)
        if adapters:
            params = dataclasses.replace(params, lora=adapters)
        if prompt.messages is not None:
            params = with_reasoning(params, self.config, self.tokenizer, prompt_ids, thinking)
        team = request.headers.get("X-Team-Id")  # the proxy's; None (not counted) straight to the server
        self.check_quota(team, len(prompt_ids), params)  # settled when the response closes (app.py), 0 if refused
        session = self.client.submit(prompt_ids, params, team=team)
        events = session_events(self.client, session, request.environ)
        return Run(len(prompt_ids), first_event(events), events, params.n, tuple(prompt_ids))
