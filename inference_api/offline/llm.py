"""The Python API for offline and embedded use: the server's engine process, flags and validation, no HTTP.

    from inference_api import LLM, SamplingParams

    with LLM(mock=True) as llm:                       # the server's flags as keyword arguments
        handle = llm.start_request("Hello", SamplingParams(max_tokens=16))
        while (out := handle.queue.get()) is not None:  # new tokens and text as they come
            print(out.text, end="")
        print(llm.generate(["a", "b"], SamplingParams(temperature=0))[0].text)

    with LLM("base.gguf", lora={"sql": "sql-lora.gguf"}) as llm:  # LoRA adapters: {name: path} or [paths]
        llm.generate("SELECT", SamplingParams(lora="sql"))   # a request's: a name, {name: scale}, or [(name, scale)]
        llm.load_adapter("chat", "chat-peft-folder/")      # and at run time: load_adapter, unload_adapter, adapters

Requests go through the same ``EngineClient`` and the same preparation (``prepare``) as the HTTP app;
sampling parameters and prompts are checked by the parsers of ``/v1/completions`` (one validation), and a bad
one raises ``ParameterError`` naming it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Iterable, Iterator, Sequence, Sized
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..config import ServerConfig
from ..engine.client import EngineClient
from ..engine.messages import AdapterInfo
from ..engine.messages import SamplingParams as EngineParams
from ..model.tokenizer import Tokenizer
from ..request.prepare import Prompt, fit_inputs, prepare
from ..request.reasoning import with_reasoning
from ..request.tools import Tools, offered, parse_tools, split_calls
from ..request_errors import RateLimited, RequestError, Unavailable
from ..web.dialects.openai.protocol import COMPLETION_SAMPLING_FIELDS as SAMPLING_FIELDS
from ..web.dialects.openai.protocol import completion_sampling, parse_messages, parse_prompt
from .results import ChoiceOutput, Output, RequestHandle, RequestOutput, RequestStatus, ResultQueue

_ANY_VOCAB = 1 << 31  # token-id checks need the model's vocabulary; they are made again at submission


class ParameterError(ValueError):
    """A bad parameter, prompt or option; ``field`` names it (the same message the HTTP APIs send)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class EngineError(RuntimeError):
    """The engine cannot take or finish the request: closed, failed, or every row and queue place taken."""


def _translate(err: RequestError) -> Exception:
    if isinstance(err, (Unavailable, RateLimited)):
        return EngineError(err.message)
    return ParameterError(err.message, err.field)


class SamplingParams:
    """Sampling parameters with the OpenAI/vLLM names and ranges of ``/v1/completions``, checked when built.

    temperature (0: greedy), top_p, top_k, max_tokens (None: as many as fit, at most 1024), stop (a string or up
    to 4), seed, presence_penalty, frequency_penalty, repetition_penalty, logprobs (None, or the chosen token's
    log-prob plus the top N, N <= 5), and any other sampling field /v1/completions accepts; ``lora``: the LoRA
    adapters the request applies (loaded by ``LLM(lora=...)`` or ``load_adapter``): a name (scale 1), a
    ``{name: scale}`` dict, or a list of names, ``(name, scale)`` pairs or llama-server's ``{"id": name, "scale":
    s}``.
    """

    def __init__(self, **params: Any):
        self.lora = _lora_request(params.pop("lora", ()))
        unknown = sorted(set(params) - SAMPLING_FIELDS)
        if unknown:
            raise ParameterError(
                f"unknown sampling parameter {unknown[0]!r}; accepted: {', '.join(sorted(SAMPLING_FIELDS | {'lora'}))}",
                unknown[0],
            )
        self.params = dict(params)
        self.resolve(_ANY_VOCAB)

    def resolve(self, vocab_size: int) -> EngineParams:
        """The engine's parameters (max_tokens None: as many as fit): the OpenAI completions parser, errors
        translated, and the request's adapters."""
        try:
            resolved = completion_sampling(self.params, vocab_size)
        except RequestError as err:
            raise _translate(err) from None
        return dataclasses.replace(resolved, lora=self.lora) if self.lora else resolved

    def __repr__(self) -> str:
        shown = {**self.params, **({"lora": self.lora} if self.lora else {})}
        return f"SamplingParams({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SamplingParams) and other.params == self.params and other.lora == self.lora


def _lora_request(lora: Any) -> tuple[tuple[str, float], ...]:
    """A request's adapters as the engine takes them, (name, scale) pairs, from any form SamplingParams accepts."""
    if isinstance(lora, str):
        lora = [lora]
    items = list(lora.items()) if isinstance(lora, dict) else list(lora)
    pairs = []
    for item in items:
        name: Any
        scale: Any
        if isinstance(item, str):
            name, scale = item, 1.0
        elif isinstance(item, dict) and ("id" in item or "name" in item):
            name, scale = item.get("id", item.get("name")), item.get("scale", 1.0)
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            name, scale = item
        else:
            raise ParameterError(f"lora: {item!r} is not a name, (name, scale) or {{'id': name, 'scale': s}}", "lora")
        if not isinstance(name, str) or isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ParameterError(f"lora: {item!r} needs an adapter's name and a number for its scale", "lora")
        pairs.append((name, float(scale)))
    return tuple(pairs)


def _lora_option(lora: Any) -> tuple[str, ...]:
    """LLM(lora=...): {name: path}, a path, or a list of paths or NAME=PATH strings -> --lora's entries."""
    if isinstance(lora, dict):
        return tuple(f"{name}={path}" for name, path in lora.items())
    if isinstance(lora, (str, Path)):
        return (str(lora),)
    return tuple(str(p) for p in lora)


def build_config(model: str | Path | None, options: dict[str, Any]) -> ServerConfig:
    """The server's configuration from keyword arguments named like its flags (``rows=8``, ``mock=True``)."""
    names = {f.name for f in fields(ServerConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ParameterError(
            f"unknown option {unknown[0]!r}; accepted: model, {', '.join(sorted(names - {'model'}))}", unknown[0]
        )
    if "model_cache_dir" in options:
        options = {**options, "model_cache_dir": Path(options["model_cache_dir"])}
    if "lora" in options:
        options = {**options, "lora": _lora_option(options["lora"])}
    return ServerConfig(model=None if model is None else str(model), **options)


class LLM:
    """The engine in a child process, as the server runs it, driven from Python.

    ``LLM(model=None, **options)``: the model the server would load for ``--model`` (None: the embedded
    default), and any server flag as a keyword argument (``rows``, ``context_length``, ``mock``, ``device``...);
    ``lora``: LoRA adapters loaded at start, ``{name: path}`` or a list of paths (each named by its file or
    folder), GGUFs from llama.cpp's convert_lora_to_gguf.py or PEFT folders, which a request names in its
    ``SamplingParams(lora=...)``.
    Use it as a context manager, or call ``close()``. Programs that create one must guard their entry point
    with ``if __name__ == "__main__":`` (the engine process is started with ``spawn``).
    """

    def __init__(self, model: str | Path | None = None, *, ready_timeout: float = 600.0, **options: Any):
        self.config = build_config(model, options)
        # past the restart bound the client is marked failed (its failure is set) and open requests end with
        # that error; the user's process is never signalled
        self._client = EngineClient(self.config, on_give_up=lambda: None).start()
        self._lock = threading.Lock()
        self._live: dict[str, ResultQueue] = {}  # requests not yet ended, in submission (= admission) order
        self._closed = False
        deadline = time.monotonic() + ready_timeout
        while self._client.ready is None:
            if self._client.failure is not None or time.monotonic() > deadline:
                why = self._client.failure or f"not ready after {ready_timeout:.0f} s"
                self._client.shutdown()
                raise EngineError(f"the engine did not start: {why}")
            time.sleep(0.05)
        self.model_name = self._client.ready.model_name
        self.context_length = self._client.ready.context_length
        self.vocab_size = self._client.ready.vocab_size
        self.task = self._client.ready.task  # generate, embed (an embedding model) or score (a reranker)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer: ``encode(text)``, ``encode_chat(messages)``, ``decode(ids)``."""
        tokenizer = self._client.tokenizer
        if tokenizer is None:  # (the client loads it before it reports the engine ready, which __init__ awaits)
            raise EngineError("the engine has not reported ready")
        return tokenizer

    # life cycle
    def close(self) -> None:
        """Interrupt every open request and stop the engine process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            queues = list(self._live.values())
        for q in queues:
            self._stop(q, "the LLM was closed")
        self._client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # LoRA adapters
    @property
    def adapters(self) -> tuple[AdapterInfo, ...]:
        """The LoRA adapters requests may name now (name, path, rank, alpha, bytes)."""
        return self._client.adapters

    def load_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        """Load a LoRA adapter (a GGUF or a PEFT folder) under a new name; ParameterError with the engine's reason
        when it cannot."""
        try:
            return self._client.load_adapter(name, str(path))
        except ValueError as err:
            raise ParameterError(str(err), "lora") from None
        except RequestError as err:
            raise _translate(err) from None

    def unload_adapter(self, name: str) -> bool:
        """Refuse an adapter to new requests (running ones finish with it); False: none of that name."""
        try:
            return self._client.unload_adapter(name)
        except ValueError as err:
            raise ParameterError(str(err), "lora") from None
        except RequestError as err:
            raise _translate(err) from None

    # embeddings and scores (an embedding model's or a reranker's engine)
    def embed(self, texts: str | Sequence[str], *, normalize: bool = True, truncate: bool = False) -> list[list[float]]:
        """Each text's vector (an embedding model: ``/v1/embeddings``' numbers; L2-normalized unless told
        otherwise); a text longer than the model's context is a ParameterError unless ``truncate``."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        return self._inputs([self.tokenizer.encode(t) for t in texts], normalize, truncate, "embed")

    def rerank(self, query: str, documents: Sequence[str], *, truncate: bool = False) -> list[float]:
        """A reranker's score of each document for the query (the classifier's output; higher: more relevant)."""
        pairs = [self.tokenizer.encode_pair(query, d) for d in documents]
        return [v[0] for v in self._inputs(pairs, False, truncate, "score")]

    def _inputs(self, inputs: list[list[int]], normalize: bool, truncate: bool, task: str) -> list[list[float]]:
        ready = self._client.ready
        if ready is None or ready.task != task:
            what = {"embed": "an embedding model", "score": "a reranker"}[task]
            raise ParameterError(f"{self.model_name} is not {what} (its task: {ready.task if ready else '?'})")
        try:
            inputs = fit_inputs(inputs, self.context_length, truncate, "input")
            session = self._client.embed(inputs, normalize)
        except RequestError as err:
            raise _translate(err) from None
        try:
            vectors: list[list[float]] = [[] for _ in inputs]
            for _ in inputs:
                event = session.events.get(timeout=600)
                if event.error is not None:
                    raise EngineError(event.error)
                vectors[event.index] = event.vector.tolist()
            return vectors
        finally:
            self._client.release(session)

    # one request at a time
    def start_request(
        self, prompt: str | Sequence[int] | Sequence[dict], params: SamplingParams | None = None
    ) -> RequestHandle:
        """Submit a prompt (text, token ids, or a conversation of {role, content} messages for the chat template)
        and return its handle at once. Raises ParameterError for a bad prompt or parameter, EngineError when the
        engine is closed or failed, or every row and queue place is taken (see ``max_waiting``)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ParameterError("params must be a SamplingParams", "params")
        prompt_ids, engine_params = self._prepare(prompt, params)
        with self._lock:
            if self._closed:
                raise EngineError("the LLM is closed")
            try:
                session = self._client.submit(prompt_ids, engine_params)
            except RequestError as err:
                raise _translate(err) from None
            queue = ResultQueue(self, session, engine_params.logprobs is not None)
            self._live[session.id] = queue
        return RequestHandle(
            session.id, tuple(prompt_ids), params, queue, prompt.tools if isinstance(prompt, Conversation) else None
        )

    def stop_request(self, handle: RequestHandle) -> RequestStatus:
        """Interrupt the request (its row is freed); output already produced stays in its queue."""
        self._stop(handle.queue, None)
        return handle.queue.status

    def release_request(self, handle: RequestHandle) -> None:
        """Free everything the request holds: stop it if it runs, and drop its unread output."""
        self._stop(handle.queue, None)
        handle.queue._release()

    def sync_request(self, handle: RequestHandle, timeout: float | None = None) -> RequestStatus:
        """Wait until the request ends (or ``timeout`` seconds pass); return its status."""
        handle.queue.wait(timeout)
        return handle.queue.status

    def _prepare(self, prompt: Any, params: SamplingParams) -> tuple[list[int], EngineParams]:
        """The HTTP APIs' preparation: the prompt parsed as /v1/completions parses it (a conversation as chat
        messages), the parameters for this model's vocabulary, then ``prepare``."""
        if _is_conversation(prompt):
            prompt = Conversation(prompt)
        try:
            tools = prompt.tools if isinstance(prompt, Conversation) else None
            if isinstance(prompt, Conversation):
                parsed = Prompt.chat(parse_messages(prompt.messages), tools)
            else:
                text, ids = parse_prompt(list(prompt) if isinstance(prompt, tuple) else prompt, self.vocab_size)
                parsed = Prompt(text=text, ids=ids)
            engine_params = params.resolve(self.vocab_size)
            if tools is not None:  # required or a named function: a grammar forces the calls
                engine_params = tools.constrain(engine_params)
            prompt_ids, engine_params = prepare(
                self.tokenizer, self.context_length, parsed, engine_params, prompt_field="prompt"
            )
            if parsed.messages is not None:  # a reasoning model's thought: in the text, its budget the server's
                engine_params = with_reasoning(engine_params, self.config, self.tokenizer, prompt_ids)
            return prompt_ids, engine_params
        except RequestError as err:
            raise _translate(err) from None

    def _stop(self, queue: ResultQueue, message: str | None) -> None:
        if queue.ended:
            return
        self._client.release(queue._session)  # the engine frees the row; later output is dropped
        queue._interrupt(message)

    def _ended(self, queue: ResultQueue) -> None:
        with self._lock:
            self._live.pop(queue._session.id, None)
        self._client.release(queue._session)

    def _queued_status(self, queue: ResultQueue) -> RequestStatus:
        """Waiting or prefilling: the engine admits requests in order, so the open requests ahead of this one
        that the engine's latest step counted in rows tell which it is."""
        rows_in_use = self._client.stats.rows_in_use
        with self._lock:
            ahead = 0
            for q in self._live.values():
                if q is queue:
                    break
                if not q._session.done:
                    ahead += 1
            else:
                return RequestStatus.WAITING  # no longer tracked: ended meanwhile
        return RequestStatus.PREFILLING if ahead < rows_in_use else RequestStatus.WAITING

    # many requests
    def generate(
        self,
        prompts: str | Iterable,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt through the rows; the results in input order. ``prompts``: one prompt or an iterable
        (text, token ids, or ``(prompt, SamplingParams)`` pairs); ``params``: one for all or one per prompt."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        return list(self.generate_iter(prompts, params, use_tqdm=use_tqdm))

    def chat(
        self,
        conversations: Sequence[dict] | Iterable[Sequence[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """``generate`` over conversations ({role, content} messages, and the chat API's tool and assistant-call
        messages) through the model's chat template. ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as
        /v1/chat/completions takes them: the model is shown the tools, a ``required`` or named choice is forced
        by a grammar, and each result's ``tool_calls`` holds the calls parsed out of its text."""
        try:
            parsed = parse_tools(tools, tool_choice, parallel_tool_calls)
        except RequestError as err:
            raise _translate(err) from None
        given: Iterable[Any] = [conversations] if _is_conversation(conversations) else conversations
        items: Iterable[Conversation] = (Conversation(c, parsed) for c in given)
        if isinstance(given, Sized):
            items = [Conversation(c, parsed) for c in given]
        return self.generate(items, params, use_tqdm=use_tqdm)

    def generate_iter(
        self,
        prompts: Iterable,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        errors: str = "raise",
    ) -> Iterator[RequestOutput]:
        """Like ``generate``, yielding each result in input order as soon as it and those before it are done,
        reading the prompts lazily (a file of any size). ``errors="return"``: a prompt the engine rejects, or a
        request it fails, gives a result with ``finish_reason="error"`` instead of raising."""
        from tqdm.auto import tqdm

        jobs = _jobs(prompts, params)
        total = len(prompts) if isinstance(prompts, Sized) else None
        bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        started, out_tokens = time.monotonic(), 0
        running: dict[int, tuple[Any, RequestHandle]] = {}
        done: dict[int, RequestOutput] = {}
        next_out, exhausted, held = 0, False, None
        try:
            while True:
                while not exhausted and self._free_places() > 0:
                    job, held = held or next(jobs, None), None
                    if job is None:
                        exhausted = True
                        break
                    index, prompt, job_params = job
                    if running and _choices(job_params) > self._free_places():
                        held = job  # its n choices take n places: it waits for them
                        break
                    shown = prompt.messages if isinstance(prompt, Conversation) else prompt
                    try:
                        running[index] = (shown, self.start_request(prompt, job_params))
                    except ParameterError as err:
                        if errors != "return":
                            raise ParameterError(f"prompt {index}: {err}", err.field) from None
                        done[index] = RequestOutput(index, shown, (), "", (), "error", 0, 0, error=str(err))
                        bar.update(1)
                finished = [i for i, (_, h) in running.items() if h.queue.ended]
                for i in finished:
                    result = _result(i, *running.pop(i))
                    if result.finish_reason == "error" and errors != "return":
                        raise EngineError(f"prompt {i} failed: {result.error}")
                    done[i] = result
                    out_tokens += result.completion_tokens
                    bar.update(1)
                if finished:
                    bar.set_postfix_str(
                        f"{out_tokens / max(time.monotonic() - started, 1e-9):.1f} tok/s", refresh=False
                    )
                while next_out in done:
                    yield done.pop(next_out)
                    next_out += 1
                if exhausted and not running:
                    return
                if running and not finished:
                    oldest = min(running)
                    running[oldest][1].queue.wait(0.02)  # wakes when the oldest ends; others are swept above
                elif not running and not finished:
                    time.sleep(0.01)  # every place is taken by requests started elsewhere
        finally:
            for _, handle in running.values():
                self.release_request(handle)
            bar.close()

    def _free_places(self) -> int:
        """Requests that may still be submitted: rows plus queue places not taken by open requests."""
        return self.config.max_open_sessions - self._client.open_places


class Conversation:
    """Marks a prompt as chat messages ({role, content}) for the chat template, even a malformed one (so its
    error names ``messages``), with the tools it offers (``tools.parse_tools``; ``chat`` builds them). Lists of
    dicts are recognised without it."""

    def __init__(self, messages: Any, tools: Tools | None = None):
        self.messages: Any = messages.messages if isinstance(messages, Conversation) else messages
        self.tools: Tools | None = (
            tools if tools is not None or not isinstance(messages, Conversation) else messages.tools
        )


def _is_conversation(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], dict)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(type(t) is int for t in value)


def _jobs(
    prompts: Iterable[Any], params: SamplingParams | Sequence[SamplingParams] | None
) -> Iterator[tuple[int, Any, SamplingParams | None]]:
    """(index, prompt, params) for each prompt; a ``(prompt, SamplingParams)`` pair brings its own."""
    per_prompt: Iterator[SamplingParams | None] = (
        itertools.repeat(params) if params is None or isinstance(params, SamplingParams) else iter(params)
    )
    for index, item in enumerate(prompts):
        try:
            own = next(per_prompt)
        except StopIteration:
            raise ParameterError(f"params has fewer entries than there are prompts ({index})", "params") from None
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], SamplingParams):
            item, own = item
        yield index, item, own


def _choices(params: SamplingParams | None) -> int:
    """The places a request takes: its n (checked when its SamplingParams were built)."""
    return int(params.params.get("n") or 1) if params is not None else 1


def _result(index: int, prompt: Any, handle: RequestHandle) -> RequestOutput:
    q = handle.queue
    parts: dict[int, list[Output]] = collections.defaultdict(list)
    while (out := q.get_nowait()) is not None:
        parts[out.index].append(out)
    choices = []
    tools = offered(handle.tools)
    for i in range(q._session.n):
        outs = parts.get(i, [])
        lps = tuple(lp for o in outs for lp in o.logprobs or ()) if outs and outs[0].logprobs is not None else None
        text = "".join(o.text for o in outs)
        calls = tuple(split_calls(text, tools.names, tools.forced)[1]) if tools is not None else ()
        choices.append(
            ChoiceOutput(
                i,
                text,
                tuple(t for o in outs for t in o.token_ids),
                q._finished.get(i) or q.finish_reason or "error",
                sum(len(o.token_ids) for o in outs),
                lps,
                calls,
            )
        )
    first = choices[0]
    return RequestOutput(
        index=index,
        prompt=prompt,
        prompt_token_ids=handle.prompt_token_ids,
        text=first.text,
        token_ids=first.token_ids,
        finish_reason=first.finish_reason,
        prompt_tokens=q.prompt_tokens,
        completion_tokens=q.generated_length,
        logprobs=first.logprobs,
        error=q.error,
        outputs=tuple(choices),
        tool_calls=first.tool_calls,
    )
