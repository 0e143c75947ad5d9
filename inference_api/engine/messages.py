"""Typed messages between the HTTP app and the engine process (pickled over multiprocessing queues)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .grammar import Grammar

if TYPE_CHECKING:
    import torch


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop sequence matched
    LENGTH = "length"  # max_tokens or the context is full
    EOS = "eos"  # the model produced an end-of-sequence token
    CANCELLED = "cancelled"  # the client went away
    ERROR = "error"  # the engine failed this request


class ErrorKind(str, enum.Enum):
    """Why the engine ended a request with an error: the HTTP status the serving layer answers before streaming."""

    INVALID = "invalid"  # the request cannot be served as asked (e.g. its grammar cannot be built): 400
    BUSY = "busy"  # its team holds its share of a queue (e.g. grammars being compiled): 429, retry shortly
    FAILED = "failed"  # the server failed: 503


@dataclass(frozen=True)
class Reasoning:
    """How a reasoning model's thought is found in a request's output (engine/reasoning.py; made by
    request/reasoning.py from the server's parser and the request)."""

    start: str = "<think>"  # the tag that opens the thought
    end: str = "</think>"  # the tag that closes it
    inside: bool = False  # the output starts inside a thought (the prompt opened it, or the model always thinks)
    budget: int | None = None  # the thought's tokens before its close is forced (None: no cap; 0: closed at once)
    close_ids: tuple[int, ...] = ()  # the tokens forced at the budget: the end tag (after a message, if any)
    split: bool = True  # the thought goes out apart (TokenEvent.reasoning); False: in the text, tags and all


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (0: off)
    # the request's one home for it: None, as many as fit (request.prepare fills it in, at most the API's default)
    max_tokens: int | None = 128
    min_tokens: int = 0  # no end token, stop token or stop string before this many tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the output (not shown), as the end token does
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: no logprobs; N: the chosen token's logprob plus the top N
    ignore_eos: bool = False
    grammar: Grammar | None = None  # the output must match it (JSON schema, regex, choice, EBNF)
    n: int = 1  # choices: each its own row and sampling state, forked from the first choice's prefill
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's log-prob (the first: None) + top N
    # the prefix cache's namespace within the request's team (vLLM's cache_salt): a prompt reuses only the cache
    # of requests with the same team and salt; None: the team's (or, without a team, the server's) shared one
    cache_salt: str | None = None
    reasoning: Reasoning | None = None  # a reasoning model's thought (None: the output is all answer)
    speculate: bool = True  # its rows may draft tokens for the model to check (where the server speculates)
    # LoRA adapters (engine/adapters.py): (name, scale) pairs, as llama-server's per-request lora [{id, scale}]
    lora: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class GenerateRequest:
    session_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    team: str | None = None  # the proxy's X-Team-Id: the prefix cache's namespace, the grammar queue's fair share


@dataclass(frozen=True)
class EmbedRequest:
    """Inputs to embed (an embedding model) or score (a reranker: each input a query and document pair): one
    TokenEvent each, its ``embedding`` the vector (L2-normalized when ``normalize``) or the score."""

    session_id: str
    inputs: tuple[tuple[int, ...], ...]
    normalize: bool = True
    team: str | None = None


@dataclass(frozen=True)
class CancelRequest:
    session_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class AdapterInfo:
    """A LoRA adapter the engine holds."""

    name: str
    path: str
    rank: int  # its tensors' largest rank
    alpha: float
    bytes: int  # its low-rank weights as held (float32 on CPU)


@dataclass(frozen=True)
class LoadAdapter:
    """Load a LoRA adapter (a GGUF file or a PEFT folder) under a name, between steps; answered by AdapterReply."""

    request_id: str
    name: str
    path: str


@dataclass(frozen=True)
class UnloadAdapter:
    """Refuse a LoRA adapter to new requests (those running finish with it); answered by AdapterReply."""

    request_id: str
    name: str


@dataclass(frozen=True)
class AdapterReply:
    """The engine's answer to LoadAdapter or UnloadAdapter: the adapter loaded (info), whether one was unloaded,
    or the error; and every adapter requests may name now."""

    request_id: str
    adapters: tuple[AdapterInfo, ...] = ()
    info: AdapterInfo | None = None
    unloaded: bool = False
    error: str | None = None


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()
    # a prompt token's (SamplingParams.prompt_logprobs), for vLLM's prompt_logprobs: its id, its rank (1: the most
    # likely) and the top tokens' ids
    token_id: int | None = None
    rank: int | None = None
    top_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """New output for one session: text that is safe to show (UTF-8 complete, clear of stop prefixes)."""

    session_id: str
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    error_kind: ErrorKind | None = None  # with error: what kind of failure, so the first event gets its status
    cached_tokens: int = 0  # prompt tokens found in the prefix cache, not computed again
    index: int = 0  # the choice (of SamplingParams.n) this output belongs to
    # with SamplingParams.prompt_logprobs, on choice 0's first event: one per prompt token (the first None)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    reasoning: str = ""  # with SamplingParams.reasoning split: the thought's text (``text`` is the answer's)
    reasoning_tokens: int = 0  # the output's tokens that belong to its thought so far (tags included)
    # an EmbedRequest's input's vector or score (``index``: which input), little-endian float32 (``vector``)
    embedding: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def vector(self) -> np.ndarray:
        """The embedding as float32 numbers (empty without one)."""
        return np.frombuffer(self.embedding or b"", dtype="<f4")


def packed_vector(vector: torch.Tensor) -> bytes:
    """A vector (a torch tensor) as TokenEvent.embedding carries it: its float32 bytes, one object to pickle. As a
    tuple of 384 Python floats, unpickling and freeing them took about a third of the web worker's time under 32
    embedding clients (2026-11-29)."""
    return bytes(vector.detach().float().cpu().numpy().astype("<f4", copy=False).tobytes())


def refusal(session_id: str, message: str) -> TokenEvent:
    """The one event of a request the engine cannot serve as asked (a 400 before anything streams)."""
    return TokenEvent(session_id, "", finish_reason=FinishReason.ERROR, error=message, error_kind=ErrorKind.INVALID)


@dataclass(frozen=True)
class EngineStats:
    """The engine's books after a step. The prefix counters and the decode steps are cumulative since that engine
    process started (a restarted engine counts from zero again; the metrics fold them into counters that never go
    down)."""

    rows_in_use: int = 0
    rows_total: int = 0
    waiting: int = 0
    kv_tokens_in_use: int = 0  # KV cache positions written for the rows in use (their prompt and output so far)
    kv_tokens_total: int = 0  # KV cache positions of all user rows: rows x context length
    prefix_queried_tokens: int = 0  # prompt tokens of admitted requests looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, the tokens found cached and reused (not computed again)
    # decode steps (no prompt chunk in them) by the rows they decoded, bucket b holding 2**(b-1) < rows <= 2**b
    # (step_rows_bucket), and the seconds those steps took, from planning to the tokens' events
    decode_steps: tuple[int, ...] = ()
    decode_seconds: tuple[float, ...] = ()
    spec_drafted_tokens: int = 0  # tokens drafted for the model to check (speculative decoding)
    spec_accepted_tokens: int = 0  # of them, the tokens it confirmed
    spec_steps: int = 0  # steps that checked drafts


def step_rows_bucket(rows: int) -> int:
    """EngineStats.decode_steps' bucket of a step that decoded ``rows`` rows: 0 for 1, 1 for 2, 2 for 3-4, 3 for
    5-8 and so on."""
    return (rows - 1).bit_length()


def step_rows_label(bucket: int) -> str:
    """The rows a bucket holds, as /metrics and the benchmark print them: "1", "2", "3-4", "5-8", ..."""
    if bucket < 2:
        return str(1 << bucket)
    return f"{(1 << (bucket - 1)) + 1}-{1 << bucket}"


@dataclass(frozen=True)
class StepOutput:
    """Everything one engine step produced, sent as one message to keep IPC per step constant."""

    events: tuple[TokenEvent, ...] = ()
    stats: EngineStats = field(default_factory=EngineStats)


@dataclass(frozen=True)
class EngineReady:
    model_dir: str  # local folder holding the tokenizer files ("" for the mock)
    model_name: str
    context_length: int
    vocab_size: int
    device: str
    dtype: str
    quantize: str = "none"  # none | int8 | int4: how the weights are held
    kv_dtype: str = ""
    matmul_dtype: str = ""  # the dtype of multi-row matmuls (batched decode and prefill)
    int8_inputs: bool = False  # every row's inputs rounded to int8 blocks by the CPU kernels
    tensor_parallel_size: int = 1  # ranks (processes) the model is split over; rank 0 is the engine process
    rank_pids: tuple[int, ...] = ()  # the process ids of ranks 1..N-1
    kernels: str = ""  # the CPU kernels' build ("native", "prebuilt avx512vnni", ...), "unavailable: why", or "" unused
    cuda_graphs: tuple[int, ...] = ()  # the batch sizes whose decode step was captured in CUDA graphs
    task: str = "generate"  # generate | embed (an embedding model) | score (a reranker)
    dims: int = 0  # an embedding model's vector size
    adapters: tuple[AdapterInfo, ...] = ()  # the LoRA adapters loaded at start (--lora)


@dataclass(frozen=True)
class EngineFailed:
    message: str
