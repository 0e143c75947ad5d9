"""OpenAI response objects, field for field: completions, chat completions, their stream chunks, usage."""
from __future__ import annotations

import hashlib
import time
import uuid
from typing import Iterator

from ...error_shapes import OPENAI, error_body
from ...generation import Generation
from ...messages import EngineReady, FinishReason, TokenEvent, TokenLogprob
from ...sse import sse

FINISH = {FinishReason.STOP: "stop", FinishReason.EOS: "stop", FinishReason.LENGTH: "length"}


def fingerprint(ready: EngineReady) -> str:
    """Stable for one model, dtype and device: what OpenAI's system_fingerprint stands for."""
    key = f"{ready.model_name}|{ready.dtype}|{ready.device}|{ready.context_length}"
    return "fp_" + hashlib.sha1(key.encode()).hexdigest()[:10]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache held (not computed again)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


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
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def response(self, gen: Generation, prompt_tokens: int) -> dict:
        lps = self.logprobs(visible(gen.logprobs, gen.finish_reason)) if self.want_logprobs else None
        body = self.envelope(self.object_name, [self.choice(gen.text, lps, FINISH.get(gen.finish_reason))])
        body["usage"] = usage(prompt_tokens, gen.completion_tokens, gen.cached_tokens)
        return body

    def opening(self) -> list[dict]:
        return []

    def chunk(self, text: str, logprobs: tuple[TokenLogprob, ...], finish: str | None) -> dict:
        lps = self.logprobs(logprobs) if self.want_logprobs and (logprobs or finish is None) else None
        return self.envelope(self.chunk_object, [self.chunk_choice(text, lps, finish)])

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

    def choice(self, text: str, logprobs, finish: str | None) -> dict:
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}

    chunk_choice = choice

    def logprobs(self, lps: tuple[TokenLogprob, ...]) -> dict:
        offsets = []
        for lp in lps:
            offsets.append(self.offset)
            self.offset += len(lp.token)
        return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [dict(lp.top) for lp in lps], "text_offset": offsets}


class ChatFormat(_Format):
    prefix, object_name, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def choice(self, text: str, logprobs, finish: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": logprobs, "finish_reason": finish}

    def opening(self) -> list[dict]:
        return [self.envelope(self.chunk_object, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}])]

    def chunk_choice(self, text: str, logprobs, finish: str | None) -> dict:
        return {"index": 0, "delta": {"content": text} if finish is None else {}, "logprobs": logprobs,
                "finish_reason": finish}

    def logprobs(self, lps: tuple[TokenLogprob, ...]) -> dict:
        def entry(token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in lps], "refusal": None}


def stream_chunks(fmt: _Format, events: Iterator[TokenEvent], prompt_tokens: int,
                  include_usage: bool, continuous_usage: bool = False) -> Iterator[bytes]:
    """The SSE body: opening chunks, one chunk per event with text, the finish chunk, usage, [DONE].

    ``include_usage``: every chunk carries ``usage: null`` and a last chunk the usage; ``continuous_usage``
    (vLLM's ``continuous_usage_stats``): every chunk carries the usage so far. An engine failure after the
    stream has started becomes a ``data: {"error": ...}`` event and ends it.
    """
    completion_tokens = cached_tokens = 0

    def send(chunk: dict) -> bytes:
        if continuous_usage:
            chunk["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        elif include_usage:
            chunk["usage"] = None
        return sse(chunk)

    for chunk in fmt.opening():
        yield send(chunk)
    for event in events:
        if event.finish_reason is FinishReason.ERROR:
            yield sse(error_body(OPENAI, 500, event.error or "generation failed"))
            return
        completion_tokens, cached_tokens = event.completion_tokens, event.cached_tokens
        lps = visible(event.logprobs, event.finish_reason)
        if event.text:
            yield send(fmt.chunk(event.text, lps, None))
            lps = ()
        if event.finished:
            if event.finish_reason not in FINISH:
                return  # cancelled: nobody is listening
            yield send(fmt.chunk("", lps, FINISH[event.finish_reason]))
    if include_usage:
        yield sse(fmt.envelope(fmt.chunk_object, []) | {"usage": usage(prompt_tokens, completion_tokens, cached_tokens)})
    yield sse("[DONE]")
