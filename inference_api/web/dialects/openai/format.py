"""OpenAI response objects, field for field: completions, chat completions, their stream chunks, usage."""

from __future__ import annotations

import copy
import hashlib
import itertools
import time
import uuid
from collections.abc import Iterator

from lifecycle.error_shapes import OPENAI, error_body

from ....engine.messages import EngineReady, FinishReason, TokenEvent, TokenLogprob
from ....request.generation import Generation
from ...sse import sse

FINISH: dict[FinishReason | None, str] = {
    FinishReason.STOP: "stop",
    FinishReason.EOS: "stop",
    FinishReason.LENGTH: "length",
}


def fingerprint(ready: EngineReady) -> str:
    """Stable for one model, dtype and device: what OpenAI's system_fingerprint stands for."""
    key = f"{ready.model_name}|{ready.dtype}|{ready.device}|{ready.context_length}"
    return "fp_" + hashlib.sha1(key.encode()).hexdigest()[:10]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache held (not computed again);
    reasoning_tokens: completion tokens that were a thought (completion_tokens_details, when there was one)."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def visible(logprobs, finish_reason: FinishReason | None) -> tuple[TokenLogprob, ...]:
    """Logprobs of the tokens the user sees: the end-of-sequence token is not part of the answer."""
    return tuple(logprobs[:-1] if finish_reason is FinishReason.EOS else logprobs)


class _Format:
    """What one endpoint's objects look like; the stream and the full response are built from it."""

    prefix = object_name = chunk_object = ""

    def __init__(self, ready: EngineReady, want_logprobs: bool):
        self.id = f"{self.prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = ready.model_name
        self.fingerprint = fingerprint(ready)
        self.want_logprobs = want_logprobs

    def envelope(self, obj: str, choices: list) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }

    def response(self, gen: Generation, prompt_tokens: int) -> dict:
        lps = self.logprobs(visible(gen.logprobs, gen.finish_reason)) if self.want_logprobs else None
        choice = self.choice(gen.text, lps, FINISH.get(gen.finish_reason))
        if gen.reasoning:
            choice["message"]["reasoning_content"] = gen.reasoning
        body = self.envelope(self.object_name, [choice])
        body["usage"] = usage(prompt_tokens, gen.completion_tokens, gen.cached_tokens, gen.reasoning_tokens)
        return body

    def opening(self) -> list[dict]:
        return []

    def for_choices(self, n: int) -> list[_Format]:
        """A formatter per choice of a request with n choices (each keeps its own stream state: text offsets,
        held text), copied before any was used; choice 0's is this one."""
        return [self] + [copy.deepcopy(self) for _ in range(1, n)]

    def chunk(self, text: str, logprobs: tuple[TokenLogprob, ...], finish: str | None) -> dict:
        lps = self.logprobs(logprobs) if self.want_logprobs and (logprobs or finish is None) else None
        return self.envelope(self.chunk_object, [self.chunk_choice(text, lps, finish)])

    def thought_chunk(self, text: str, logprobs: tuple[TokenLogprob, ...]) -> dict:
        """A piece of a reasoning model's thought: a chat delta of ``reasoning_content`` (only chat has one)."""
        lps = self.logprobs(logprobs) if self.want_logprobs else None
        delta = {"reasoning_content": text}
        return self.envelope(self.chunk_object, [{"index": 0, "delta": delta, "logprobs": lps, "finish_reason": None}])

    def chunks(self, text: str, logprobs: tuple[TokenLogprob, ...], finish: str | None) -> list[dict]:
        """The chunks for a piece of text (or the finish): one, unless the format holds text back or splits it
        (tool calls: ``tool_format``)."""
        return [self.chunk(text, logprobs, finish)]

    def choice(self, text: str, logprobs, finish: str | None) -> dict:
        raise NotImplementedError

    def chunk_choice(self, text: str, logprobs, finish: str | None) -> dict:
        raise NotImplementedError

    def logprobs(self, lps: tuple[TokenLogprob, ...]) -> dict:
        raise NotImplementedError


class CompletionFormat(_Format):
    prefix, object_name, chunk_object = "cmpl-", "text_completion", "text_completion"

    def __init__(self, ready: EngineReady, want_logprobs: bool):
        super().__init__(ready, want_logprobs)
        self.offset = 0  # text_offset continues across stream chunks
        self.echo: str | None = None  # echo: the prompt's text, before each choice's (streamed: its first chunk)
        self.first_token = ""  # echo with logprobs: the first prompt token's text (it has no log-prob)
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # the engine's, the first None
        self.top = 0  # echo with logprobs: the top N of the request's logprobs
        self.vllm_top: int | None = None  # vLLM's prompt_logprobs: each choice's prompt_logprobs with the top N

    def scoring(
        self, echo: str | None, first_token: str, prompt_logprobs, top: int | None, vllm_top: int | None
    ) -> None:
        """What echo and the prompt's log-probs show: the prompt's text (None: no echo), its first token's text,
        the engine's log-probs, the request's logprobs and prompt_logprobs."""
        self.echo, self.first_token, self.prompt_logprobs = echo, first_token, prompt_logprobs
        self.top, self.vllm_top = top or 0, vllm_top

    def _prompt_rest(self) -> list[TokenLogprob]:
        """The prompt's log-probs after its first token's (which has none)."""
        rest: list[TokenLogprob] = []
        for lp in (self.prompt_logprobs or ())[1:]:
            if lp is None:
                raise ValueError("only the prompt's first token has no log-prob")
            rest.append(lp)
        return rest

    def _echoed(self, echo: str) -> dict | None:
        """The prompt's part of the logprobs object (its first token: null), offsets from 0."""
        self.offset = len(echo)
        if not self.want_logprobs or self.prompt_logprobs is None:
            return None
        rest = self._prompt_rest()
        tokens = [self.first_token] + [lp.token for lp in rest]
        offsets = [0, *itertools.accumulate(len(t) for t in tokens[:-1])]
        return {
            "tokens": tokens,
            "token_logprobs": [None, *(lp.logprob for lp in rest)],
            "top_logprobs": [None, *(dict(lp.top[: self.top]) for lp in rest)],
            "text_offset": offsets,
        }

    def _vllm_prompt_logprobs(self) -> list | None:
        """vLLM's prompt_logprobs: None for the first token, then per token {id: {logprob, rank, decoded_token}}
        for the token itself and the top N."""
        if self.prompt_logprobs is None:
            return None
        out: list[dict | None] = [None]
        for lp in self._prompt_rest():
            entry = {
                str(i): {"logprob": v, "rank": k + 1, "decoded_token": t}
                for k, (i, (t, v)) in enumerate(zip(lp.top_ids[: self.vllm_top], lp.top[: self.vllm_top]))
            }
            entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.token}
            out.append(entry)
        return out

    def _scored(self, choice: dict) -> dict:
        if self.vllm_top is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs()
        return choice

    def opening(self) -> list[dict]:
        if self.echo is None and self.vllm_top is None:
            return []
        head = self._echoed(self.echo) if self.echo is not None else None
        return [self.envelope(self.chunk_object, [self._scored(self.choice(self.echo or "", head, None))])]

    def response(self, gen: Generation, prompt_tokens: int) -> dict:
        head = self._echoed(self.echo) if self.echo is not None else None
        body = super().response(gen, prompt_tokens)
        choice = self._scored(body["choices"][0])
        if self.echo is not None:
            choice["text"] = self.echo + choice["text"]
            if head is not None and choice["logprobs"] is not None:
                choice["logprobs"] = {k: head[k] + choice["logprobs"][k] for k in head}
        return body

    def choice(self, text: str, logprobs, finish: str | None) -> dict:
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}

    chunk_choice = choice

    def logprobs(self, lps: tuple[TokenLogprob, ...]) -> dict:
        offsets = []
        for lp in lps:
            offsets.append(self.offset)
            self.offset += len(lp.token)
        return {
            "tokens": [lp.token for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [dict(lp.top) for lp in lps],
            "text_offset": offsets,
        }


class ChatFormat(_Format):
    prefix, object_name, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def choice(self, text: str, logprobs, finish: str | None) -> dict:
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    def opening(self) -> list[dict]:
        return [
            self.envelope(
                self.chunk_object,
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
            )
        ]

    def chunk_choice(self, text: str, logprobs, finish: str | None) -> dict:
        return {
            "index": 0,
            "delta": {"content": text} if finish is None else {},
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    def logprobs(self, lps: tuple[TokenLogprob, ...]) -> dict:
        def entry(token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {
            "content": [
                {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
            ],
            "refusal": None,
        }


def response_body(fmt: _Format, gens: list[Generation], prompt_tokens: int) -> dict:
    """The whole response of a request's choices (``fmt.response`` of each, as choice 0..n-1); usage counts the
    prompt once and every choice's tokens."""
    bodies = [f.response(gen, prompt_tokens) for f, gen in zip(fmt.for_choices(len(gens)), gens)]
    body = bodies[0]
    if len(gens) > 1:
        body["choices"] = [dict(b["choices"][0], index=i) for i, b in enumerate(bodies)]
        completion, thought = sum(g.completion_tokens for g in gens), sum(g.reasoning_tokens for g in gens)
        body["usage"] = usage(prompt_tokens, completion, gens[0].cached_tokens, thought)
    return body


def stream_chunks(
    fmt: _Format,
    events: Iterator[TokenEvent],
    prompt_tokens: int,
    include_usage: bool,
    continuous_usage: bool = False,
    n: int = 1,
) -> Iterator[bytes]:
    """The SSE body: opening chunks, one chunk per event with text, the finish chunk, usage, [DONE].

    ``include_usage``: every chunk carries ``usage: null`` and a last chunk the usage; ``continuous_usage``
    (vLLM's ``continuous_usage_stats``): every chunk carries the usage so far. An engine failure after the
    stream has started becomes a ``data: {"error": ...}`` event and ends it. With n choices, each chunk is one
    choice's (its ``index``), each choice has its opening and finish chunks, and usage counts the prompt once
    and every choice's tokens.
    """
    choice_tokens: dict[int, int] = {}
    thought_tokens: dict[int, int] = {}
    cached_tokens = 0
    fmts = fmt.for_choices(n)
    held: dict[int, tuple] = {}  # log-probs of an event without text (choice 0's first: the prompt's log-probs)

    def totals() -> dict:
        return usage(prompt_tokens, sum(choice_tokens.values()), cached_tokens, sum(thought_tokens.values()))

    def send(chunk: dict, index: int) -> bytes:
        for choice in chunk["choices"]:
            choice["index"] = index
        if continuous_usage:
            chunk["usage"] = totals()
        elif include_usage:
            chunk["usage"] = None
        return sse(chunk)

    for i, f in enumerate(fmts):
        for chunk in f.opening():
            yield send(chunk, i)
    for event in events:
        if event.finish_reason is FinishReason.ERROR:
            yield sse(error_body(OPENAI, 500, event.error or "generation failed"))
            return
        i, fmt = event.index, fmts[event.index]
        choice_tokens[i], thought_tokens[i] = event.completion_tokens, event.reasoning_tokens
        if i == 0:
            cached_tokens = event.cached_tokens
        lps = held.pop(i, ()) + visible(event.logprobs, event.finish_reason)
        if event.reasoning:  # the thought comes before the answer, in an event as in the output
            yield send(fmt.thought_chunk(event.reasoning, lps), i)
            lps = ()
        if not event.text and not event.finished:
            held[i] = lps
            continue
        if event.text:
            for chunk in fmt.chunks(event.text, lps, None):
                yield send(chunk, i)
            lps = ()
        if event.finished:
            if event.finish_reason not in FINISH:
                return  # cancelled: nobody is listening
            for chunk in fmt.chunks("", lps, FINISH[event.finish_reason]):
                yield send(chunk, i)
    if include_usage:
        yield sse(fmt.envelope(fmt.chunk_object, []) | {"usage": totals()})
    yield sse("[DONE]")
