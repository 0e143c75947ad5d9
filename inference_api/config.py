"""The one server configuration, built once at the entry point from CLI flags and the environment."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_STOP_SEQUENCES = 8  # lets h2oGPT's six through; TGI's --max-stop-sequences
MAX_CHOICES = 8  # OpenAI's n: choices of one request, each its own row, forked from one prefill


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    threads: int = 128  # gunicorn gthread threads: one per open stream
    model: str | None = None  # None: the embedded SmolLM2 GGUF; else a hub id, a folder or a .gguf path
    model_cache_dir: Path = Path("model_cache")
    served_model_name: str | None = None  # None: derived from the model
    # more models beside the first, each started when a request names it (web/models.py): --model given again,
    # and every GGUF in --models-dir
    models: tuple[str, ...] = ()
    models_dir: str | None = None
    models_max: int = 0  # models loaded at once at most (0: as many as memory holds)
    idle_unload_seconds: float = 0.0  # a model other than the first unloaded after this long unused (0: never)
    model_load_timeout: float = 120.0  # seconds a request waits for its model to load before a 503
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    quantize: str = "auto"  # auto (a GGUF's own quantization, else none) | none | int8 | int4
    kv_dtype: str = (
        "auto"  # auto (int8 with quantized weights on CPU, else the model's) | float32 | bfloat16 | float16 | int8
    )
    # the CPU kernels' instruction-set level: auto (a build for this CPU) | avx2 | avx512vnni (that level's build,
    # and the plan as on a CPU with only its instructions: to measure one level against another on one machine)
    cpu_level: str = "auto"
    rows: int = 32  # fixed user rows, each with its own KV cache
    context_length: int = 2048  # KV positions per row (prompt + output)
    prefill_chunk: int = 512  # prompt tokens prefilled per engine step, so long prompts never stall streams
    prefix_cache: bool = True  # start a prompt after the longest prefix some row's KV cache still holds
    tensor_parallel_size: int = 1  # processes the compact model's heads and MLP columns are split over (gloo, CPU)
    cuda_graphs: bool = True  # on CUDA, the compact model's decode step replayed from CUDA graphs per batch bucket
    max_waiting: int = 64  # requests allowed to wait for a free row; beyond it: 503
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    max_stop_sequences: int = (
        DEFAULT_MAX_STOP_SEQUENCES  # stop strings per request, every API (TGI's --max-stop-sequences; h2oGPT sends 6)
    )
    mock: bool = False
    mock_tokens_per_second: float = 50.0
    allow_download: bool = False  # let transformers fetch a hub model (off: no network at run time)
    torch_threads: int = 0  # 0: torch's default
    log_level: str = "info"
    drain_timeout: float = 60.0  # on SIGTERM/SIGINT: seconds running streams may take to finish
    skip_preflight: bool = False  # start even when the memory/disk estimate says the model will not fit
    engine_max_restarts: int = 5  # engine crashes restarted within ENGINE_RESTART_WINDOW before the worker exits
    header_timeout: float = 10.0  # seconds a client has to send its request headers
    body_timeout: float = 30.0  # seconds a client has to send its request body
    # generated tokens per team (the proxy's X-Team-Id) in any 60 seconds before new requests get 429; 0: off
    tokens_per_minute_per_team: int = 60000
    # a prompt token's cost in that quota, in generated tokens (prefill computes a chunk of them in one step)
    prompt_token_weight: float = 0.25
    # rows and queue places one team's open sessions may take in this server (a request with n choices takes n); 0: off
    max_places_per_team: int = 16
    redis_url: str | None = None  # Redis shared by every server replica for the token quota (None: in-process)
    # the Responses API's stored responses (store: true): at most this many, each kept this many seconds
    responses_store_max: int = 1000
    responses_store_seconds: float = 3600.0
    # a reasoning model's thought (request/reasoning.py): how it is marked (auto: as the chat template shows it),
    # whether the chat APIs return it apart (auto) or in the text as written (none), and its token budget
    reasoning_parser: str = "auto"
    reasoning_format: str = "auto"
    reasoning_budget: int = -1  # -1: no cap; 0: the thought is closed at once; N: closed after N tokens
    reasoning_budget_message: str = ""  # written before the end tag when the budget closes a thought
    # a generating model's token vectors as embeddings instead of its text (as llama-server's --embedding), pooled
    # over the input's tokens: last | mean
    embedding: bool = False
    pooling: str = "last"
    # the prompt cache beyond the rows (engine/prompt_cache.py): MiB of host memory for the caches of conversations
    # whose rows were taken (-1: auto, 4096 or a quarter of the memory the server may use if less; 0: off), and a
    # folder that keeps them across restarts (None: memory only)
    cache_ram: int = -1
    prompt_cache_dir: Path | None = None
    # speculative decoding (engine/speculative.py): drafts from each row's own prompt and output, checked by the
    # model in one forward; off: every token its own step
    spec_type: str = "ngram"
    spec_draft_max: int = 16  # tokens a row drafts per step at most
    spec_ngram_min: int = 2  # the shortest n-gram looked up
    spec_ngram_max: int = 4  # the longest
    spec_max_rows: int = 8  # no row drafts in a step that decodes more rows than this
    draft_model: str | None = None  # a smaller GGUF of the same vocabulary that drafts instead of prompt lookup
    # LoRA adapters loaded at start, NAME=PATH (a bare PATH: named by its file or folder), a GGUF from llama.cpp's
    # convert_lora_to_gguf.py or a PEFT folder; requests choose theirs by name (model/lora.py)
    lora: tuple[str, ...] = ()
    test_fault_text: str | None = None  # TESTS ONLY: fail post-processing of requests whose prompt contains this
    # INTERNAL_SECRET (environment only, never a flag): every request but GET/HEAD /health must carry it in
    # X-Internal-Secret, which the proxy adds; None (the one-process dev stack): no check
    internal_secret: str | None = field(default=None, repr=False)

    @property
    def max_open_sessions(self) -> int:
        return self.rows + self.max_waiting

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ServerConfig:
        return cls.from_args([], env)

    @classmethod
    def from_args(cls, argv: Sequence[str], env: Mapping[str, str] | None = None) -> ServerConfig:
        env = os.environ if env is None else env
        options = flag_values(vars(build_parser(env).parse_args(list(argv))))
        return cls(**options, internal_secret=env.get("INTERNAL_SECRET") or None)


def _bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    return value.strip().lower() in ("1", "true", "yes", "on")


# field name -> (environment variable, help)
_ENV = {
    "host": ("HOST", "listen address"),
    "port": ("PORT", "listen port"),
    "threads": ("THREADS", "gunicorn threads (concurrent streams)"),
    "model": ("MODEL", "hub id, local folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)"),
    "model_cache_dir": ("MODEL_CACHE_DIR", "where converted models are kept"),
    "served_model_name": ("SERVED_MODEL_NAME", "model name used in URLs and API responses"),
    "models_dir": (
        "MODELS_DIR",
        "serve every GGUF in this folder (and its subfolders) too, by its file name, each loaded when a request "
        "names it",
    ),
    "models_max": ("MODELS_MAX", "models loaded at once at most, the first one counted (0: as many as memory holds)"),
    "idle_unload_seconds": (
        "IDLE_UNLOAD_SECONDS",
        "unload a model other than the first once nobody has used it for this long (0: never)",
    ),
    "model_load_timeout": (
        "MODEL_LOAD_TIMEOUT",
        "seconds a request waits for its model to load (past it: 503 with Retry-After)",
    ),
    "device": ("DEVICE", "auto, cpu, cuda or cuda:N"),
    "dtype": ("DTYPE", "auto, float32, float16 or bfloat16"),
    "quantize": ("QUANTIZE", "weights: auto (a GGUF keeps its own quantization), none, int8 or int4"),
    "kv_dtype": ("KV_DTYPE", "KV cache: auto, float32, bfloat16, float16 or int8"),
    "cpu_level": (
        "CPU_LEVEL",
        "the CPU kernels' instruction-set level: auto (built for this CPU), avx2 (with FMA and F16C) or avx512vnni; "
        "a level the CPU lacks stops the start",
    ),
    "rows": ("MAX_USERS", "user rows decoded together"),
    "context_length": ("CONTEXT_LENGTH", "tokens per row (prompt + output)"),
    "prefill_chunk": ("PREFILL_CHUNK", "prompt tokens prefilled per step"),
    "prefix_cache": ("PREFIX_CACHE", "reuse the cached keys and values of a prompt's longest prefix found in any row"),
    "tensor_parallel_size": (
        "TENSOR_PARALLEL_SIZE",
        "processes the model's attention heads and MLP columns are "
        "split over (each holds its share of the weights and KV cache; gloo on CPU)",
    ),
    "cuda_graphs": (
        "CUDA_GRAPHS",
        "on CUDA, capture the decode step in CUDA graphs, one per batch-size bucket (--no-cuda-graphs: run it eagerly)",
    ),
    "max_waiting": ("MAX_WAITING", "requests that may wait for a row before 503"),
    "max_body_bytes": ("MAX_BODY_BYTES", "largest accepted request body in bytes"),
    "max_stop_sequences": ("MAX_STOP_SEQUENCES", "stop sequences accepted per request"),
    "mock": ("MOCK_MODEL", "serve the mock backend (no weights)"),
    "mock_tokens_per_second": ("MOCK_TOKENS_PER_SECOND", "mock backend decode rate"),
    "allow_download": ("ALLOW_DOWNLOAD", "allow fetching hub models at start-up"),
    "torch_threads": ("TORCH_THREADS", "torch intra-op threads in the engine (0: default)"),
    "log_level": ("LOG_LEVEL", "gunicorn and app log level"),
    "drain_timeout": ("DRAIN_TIMEOUT", "seconds running streams get to finish after SIGTERM/SIGINT"),
    "skip_preflight": ("SKIP_PREFLIGHT", "start even if the memory/disk pre-flight check fails"),
    "engine_max_restarts": (
        "ENGINE_MAX_RESTARTS",
        "engine restarts allowed within 10 minutes before the worker exits (and gunicorn replaces it)",
    ),
    "header_timeout": ("HEADER_TIMEOUT", "seconds a client has to send its request headers"),
    "body_timeout": ("BODY_TIMEOUT", "seconds a client has to send its request body"),
    "tokens_per_minute_per_team": (
        "TOKENS_PER_MINUTE_PER_TEAM",
        "tokens a team (the proxy's X-Team-Id) may have "
        "generated in the last 60 seconds before its new requests get 429 (0: no quota)",
    ),
    "prompt_token_weight": (
        "PROMPT_TOKEN_WEIGHT",
        "a prompt token's cost in the token quota, in generated tokens (prefill computes a whole chunk of prompt "
        "tokens in one step, decoding one token a step)",
    ),
    "max_places_per_team": (
        "MAX_PLACES_PER_TEAM",
        "rows and queue places one team's (X-Team-Id's) open requests may take in this server, a request with n "
        "choices taking n, before its new requests get 429 (0: no cap)",
    ),
    "redis_url": (
        "REDIS_URL",
        "Redis shared by every server replica for the team token quota (none: counted in "
        "this process; while Redis is unreachable each replica counts alone)",
    ),
    "responses_store_max": (
        "RESPONSES_STORE_MAX",
        "stored responses of the Responses API (store: true) kept at most, each private to its team; the oldest "
        "goes first (0: none stored)",
    ),
    "responses_store_seconds": ("RESPONSES_STORE_SECONDS", "seconds a stored response is kept"),
    "reasoning_parser": (
        "REASONING_PARSER",
        "how a reasoning model's thought is marked: auto (as the chat template shows it: none without think tags), "
        "deepseek_r1 (<think>...</think>, the model always thinks), qwen3 (<think>...</think> when the model or the "
        "template opens it) or none",
    ),
    "reasoning_format": (
        "REASONING_FORMAT",
        "auto: the chat APIs return the thought apart (reasoning_content, reasoning items, thinking blocks); "
        "none: in the answer's text, tags and all",
    ),
    "reasoning_budget": (
        "REASONING_BUDGET",
        "thought tokens before the model is made to close its thought (-1: no cap, 0: at once); a request's own "
        "budget takes its place",
    ),
    "reasoning_budget_message": (
        "REASONING_BUDGET_MESSAGE",
        "text written before the end tag when the budget closes a thought",
    ),
    "draft_model": (
        "DRAFT_MODEL",
        "a smaller GGUF of the same vocabulary whose greedy tokens are the drafts (instead of prompt lookup; as "
        "llama-server's -md), with rows and a KV cache of its own",
    ),
    "lora": (
        "LORA",
        "a LoRA adapter loaded at start as NAME=PATH (a PATH alone: named by its file or folder): a GGUF from "
        "llama.cpp's convert_lora_to_gguf.py or a PEFT folder; repeat the flag for more (the environment: separated "
        "by commas)",
    ),
    "embedding": (
        "EMBEDDING",
        "serve a generating model's token vectors as embeddings (/v1/embeddings, /embed) instead of text, as "
        "llama-server's --embedding (an embedding model's GGUF embeds without it)",
    ),
    "pooling": ("POOLING", "with --embedding: the input's vector is its last token's (last) or their mean (mean)"),
    "cache_ram": (
        "CACHE_RAM",
        "MiB of host memory for the prompt cache beyond the rows: the keys and values of conversations whose rows "
        "were taken, restored instead of computed again (-1: 4096 or a quarter of the memory the server may use if "
        "less: the machine's or its container's; "
        "0: off)",
    ),
    "prompt_cache_dir": (
        "PROMPT_CACHE_DIR",
        "a folder that keeps the prompt cache across restarts (checked on load; up to four times --cache-ram)",
    ),
    "spec_type": (
        "SPEC_TYPE",
        "speculative decoding: ngram (drafts from each row's own prompt and output, checked in one forward; the "
        "same tokens as off) or off",
    ),
    "spec_draft_max": ("SPEC_DRAFT_MAX", "tokens a row drafts per step at most"),
    "spec_ngram_min": ("SPEC_NGRAM_MIN", "the shortest n-gram of a row's last tokens looked up for a draft"),
    "spec_ngram_max": ("SPEC_NGRAM_MAX", "the longest n-gram looked up"),
    "spec_max_rows": (
        "SPEC_MAX_ROWS",
        "no row drafts in a step that decodes more rows than this (below it, drafts are taken where the measured "
        "costs say they pay)",
    ),
    "test_fault_text": ("TEST_FAULT_TEXT", "for tests only: fail post-processing of prompts containing this text"),
}

_CHOICES = {
    "dtype": ("auto", "float32", "float16", "bfloat16"),
    "quantize": ("auto", "none", "int8", "int4"),
    "kv_dtype": ("auto", "float32", "float16", "bfloat16", "int8"),
    "cpu_level": ("auto", "avx2", "avx512vnni"),
    "reasoning_parser": ("auto", "deepseek_r1", "qwen3", "none"),
    "reasoning_format": ("auto", "none"),
    "spec_type": ("ngram", "off"),
    "pooling": ("last", "mean"),
}


def flag_values(parsed: Mapping[str, Any]) -> dict[str, Any]:
    """ServerConfig's fields from build_parser's parsed flags (among others a caller added): --model given again
    makes the first the server's model and the others ``models``, loaded when a request names them."""
    names = {f.name for f in fields(ServerConfig)}
    out = {k: v for k, v in parsed.items() if k in names}
    given = out.pop("model", (None,))
    out["model"], out["models"] = given[0], tuple(given[1:])
    return out


class _Append(argparse.Action):
    """A repeatable flag's values as a tuple: the first given replaces the environment's, the others add to it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        held = getattr(namespace, self.dest)
        setattr(namespace, self.dest, (*(() if held is self.default else held), values))


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference_api", description="Serve an LLM over HTTP.")
    for f in fields(ServerConfig):
        if f.name in ("internal_secret", "models"):  # the secret from the environment only (a flag would show it
            continue  # in the process list); models from --model given again
        var, help_text = _ENV[f.name]
        default = f.default
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",):
            raw_bool = env.get(var)
            default = _bool(raw_bool) if raw_bool is not None else default
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=f"{help_text} (env {var})",
            )
            continue
        convert = {"int": int, "float": float, "Path": Path}.get(str(f.type), str)
        raw = env.get(var)
        if f.name == "model":  # repeatable: every model after the first is loaded when a request names it
            parser.add_argument(
                flag,
                dest=f.name,
                action=_Append,
                default=(raw or None,),
                help=f"{help_text}; again: one more (env {var})",
            )
            continue
        if f.name == "lora":  # repeatable, each flag one more
            listed = tuple(v.strip() for v in (raw or "").split(",") if v.strip())
            parser.add_argument(flag, dest=f.name, action=_Append, default=listed, help=f"{help_text} (env {var})")
            continue
        parser.add_argument(
            flag,
            dest=f.name,
            type=convert,
            default=convert(raw) if raw else default,
            choices=_CHOICES.get(f.name),
            help=f"{help_text} (env {var}, default {default})",
        )
    return parser
