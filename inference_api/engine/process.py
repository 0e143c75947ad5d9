"""The backend process: build the engine, then loop: read requests, step, push outputs."""

from __future__ import annotations

import dataclasses
import logging
import queue
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ServerConfig
from .lifeline import die_with_parent, release_free_memory, scheduling_class, settle_after_load
from .messages import (
    AdapterReply,
    CancelRequest,
    EmbedRequest,
    EngineFailed,
    EngineReady,
    GenerateRequest,
    LoadAdapter,
    Shutdown,
    StepOutput,
    UnloadAdapter,
)

if TYPE_CHECKING:  # (imported where used: the web worker imports this module for run_engine, without torch)
    from .adapters import Adapters
    from .embedder import Embedder
    from .engine import Engine
    from .prompt_cache import PromptCache
    from .speculative import ModelDrafter

log = logging.getLogger(__name__)


def _engine(config: ServerConfig, *args, **kwargs) -> Engine:
    from .engine import Engine

    if config.test_fault_text:
        from .faults import FaultyEngine

        return FaultyEngine(*args, fault_text=config.test_fault_text, **kwargs)
    return Engine(*args, **kwargs)


def build_engine(config: ServerConfig) -> tuple[Engine | Embedder, EngineReady]:
    from ..model.loader import model_name
    from .speculative import spec_config

    if config.mock:
        if config.lora:
            raise RuntimeError("--lora: the mock engine takes no LoRA adapters (it has no weights)")
        from ..mock.runner import MockRunner
        from ..mock.tokenizer import EOS, ByteTokenizer

        mock = MockRunner(config.rows, config.mock_tokens_per_second)
        engine = _engine(
            config,
            mock,
            ByteTokenizer(),
            config.rows,
            config.context_length,
            config.prefill_chunk,
            frozenset([EOS]),
            prefix_cache=config.prefix_cache,  # (no speculation: the mock's one token a step is its stated rate)
            prompt_cache=make_prompt_cache(config, mock, ""),
            pooling=config.pooling if config.embedding else None,
        )
        ready = EngineReady("", model_name(config), config.context_length, mock.vocab_size, "cpu", "none")
        if config.embedding:  # (the mock's token vectors: 16 numbers)
            ready = dataclasses.replace(ready, task="embed", dims=16)
        return engine, ready

    import torch

    from ..kernels import WITHOUT_KERNELS, load_kernels
    from ..model.loader import eos_ids, gguf_source, gguf_target, resolve_model_dir
    from .plan import make_plan, model_facts, probe_machine

    encoder = encoder_gguf(config)
    if encoder is not None:
        return build_embedder(config, encoder)
    gguf = gguf_source(config)
    from ..model.tokenizer import load_tokenizer
    from .constrain import for_tokenizer
    from .model_runner import load_runner
    from .parallel import start_group, threads_per_rank

    folder = gguf_target(config, gguf) if gguf is not None else resolve_model_dir(config)
    plan = make_plan(config, model_facts(gguf, folder), probe_machine(config.device))
    threads = threads_per_rank(config.torch_threads, plan.tp)
    if threads:
        torch.set_num_threads(threads)
    kernels = load_kernels(config.model_cache_dir, level=plan.cpu_level) if plan.cpu_kernels else None
    kernels_state = kernels.build if kernels is not None else ""
    if plan.cpu_kernels and kernels is None:
        plan = plan.without_cpu_kernels()
        kernels_state = f"unavailable: {WITHOUT_KERNELS}"
    # a GGUF of a described architecture is read straight from its file; anything else through transformers
    direct = gguf is not None and plan.model == "compact"
    model_dir = resolve_model_dir(config, weights=not direct) if gguf is not None else folder
    tokenizer = load_tokenizer(model_dir)
    eos = eos_ids(model_dir, tokenizer)
    source = gguf if direct else None
    # the runner holds its own (packed or quantized) copies of the weights; with --tensor-parallel-size N, rank 0's
    # share of them, ranks 1..N-1 started beside it (parallel.py)
    if plan.tp > 1:
        runner = start_group(config, plan, kernels, source, model_dir)
    else:
        runner = load_runner(config, plan, kernels, source, model_dir)
    settle_after_load()
    if plan.model != "compact":
        log.warning(
            "architecture %r is not described for the compact decoder: it runs on transformers' layers "
            "(correct, slower)",
            plan.arch,
        )
    adapters = load_adapters(config, runner)
    rings = sorted({n for n in runner.cache.layer_slots if n < config.context_length})
    log.info(
        "model %s on %s; KV cache %.0f MiB%s for %d rows x %d tokens%s",
        model_dir,
        plan.describe(),
        runner.cache.nbytes / 2**20,
        " per rank" if plan.tp > 1 else "",
        config.rows,
        config.context_length,
        f" (sliding-window layers in rings of {', '.join(map(str, rings))})" if rings else "",
    )
    engine = _engine(
        config,
        runner,
        tokenizer,
        config.rows,
        config.context_length,
        config.prefill_chunk,
        eos,
        prefix_cache=config.prefix_cache,
        constraints=for_tokenizer(tokenizer, runner.vocab_size, eos),
        # speculation where a draft's forward gives each token the numbers of its own step (runner.verifies)
        spec=spec_config(config) if getattr(runner, "verifies", False) else None,
        drafter=load_drafter(config, tokenizer, kernels) if config.draft_model else None,
        prompt_cache=make_prompt_cache(config, runner, gguf or model_dir, plan.tp),
        pooling=config.pooling if config.embedding else None,
        adapters=adapters,
        kernels=kernels,
    )
    if config.embedding and not getattr(runner, "embeds", False):
        raise RuntimeError(f"--embedding: architecture {plan.arch!r} gives no token vectors (the compact decoder's do)")
    ready = EngineReady(
        str(model_dir),
        model_name(config),
        config.context_length,
        runner.vocab_size,
        plan.device,
        plan.dtype,
        plan.quantize,
        plan.kv_dtype,
        plan.matmul_dtype,
        plan.int8_inputs,
        tensor_parallel_size=plan.tp,
        rank_pids=getattr(runner, "pids", ()),
        kernels=kernels_state,
        cuda_graphs=decode_graphs(runner),
        task="embed" if config.embedding else "generate",
        dims=int(runner.model.norm.shape[0]) if config.embedding else 0,
        adapters=adapters.infos if adapters is not None else (),
    )
    return engine, ready


def load_adapters(config: ServerConfig, runner) -> Adapters | None:
    """The engine's LoRA adapters, --lora's loaded (a file that does not fit the model stops the start, with its
    reason); None where the runner takes none (a tensor-parallel group's)."""
    from ..model.lora_files import adapter_specs
    from .adapters import Adapters

    if not hasattr(runner, "add_adapter"):
        if config.lora:
            raise RuntimeError("--lora: a tensor-parallel model takes no LoRA adapters")
        return None
    adapters = Adapters(runner)
    for name, path in adapter_specs(config.lora):
        try:
            adapters.load(name, path)
        except ValueError as exc:
            raise RuntimeError(f"--lora {name}={path}: {exc}") from None
    return adapters


def engine_environment(config: ServerConfig) -> dict[str, str]:
    """What an engine process's environment adds to the server's (libraries read it as they load: set before the
    process starts). An embedding model's engine: libgomp's threads spin 10,000 rounds after a parallel region
    before they sleep, where its default (300,000) keeps the second core from the web worker and the client
    between one client's forwards. all-MiniLM-L6-v2 Q8_0 on 2 cores, 2026-11-29, alternating runs of bench.py
    --embeddings: one client 235 to 332 texts/s against 216 to 279 (three pairs), 32 clients 499 to 529 against
    519 to 543 (the same within the noise: there the forward runs on one thread). A decoder's engine keeps the
    default (32 streams lost 5 to 11 % with it, 2026-11-27); a value the server's environment sets is kept."""
    try:
        encoder = not config.mock and encoder_gguf(config) is not None
    except Exception:  # a file the engine cannot read: its start says why
        return {}
    return {"GOMP_SPINCOUNT": "10000"} if encoder else {}


def encoder_gguf(config: ServerConfig) -> Path | None:
    """The served GGUF when it is an embedding model's or a reranker's (model/encoder.py runs it), else None."""
    from ..model.gguf_meta import read_header
    from ..model.loader import gguf_source
    from .plan import is_encoder

    gguf = gguf_source(config)
    return gguf if gguf is not None and gguf.is_file() and is_encoder(read_header(gguf)["arch"]) else None


def build_embedder(config: ServerConfig, gguf: Path) -> tuple[Embedder, EngineReady]:
    """The engine of an embedding model or a reranker (a GGUF of an encoder architecture)."""
    import torch

    from ..model.encoder import BertEncoder
    from ..model.loader import model_name, resolve_model_dir
    from .embedder import Embedder
    from .plan import INT8_LAYOUT, make_plan, model_facts, probe_machine

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    from ..kernels import WITHOUT_KERNELS, load_kernels
    from ..model.linear import linear_factory

    folder = resolve_model_dir(config, weights=False)  # its tokenizer, as llama.cpp reads the file's
    # the encoder runs on the CPU, on the kernels unless another device is asked for: at the plan's level
    # (--cpu-level, checked against this CPU as a decoder's; none where the plan takes a GPU: this CPU's own build)
    on_cpu = config.device in ("auto", "cpu")
    plan = make_plan(config, model_facts(gguf, None), probe_machine(config.device))
    kernels = load_kernels(config.model_cache_dir, level=plan.cpu_level) if on_cpu else None
    built = "" if not on_cpu else kernels.build if kernels is not None else f"unavailable: {WITHOUT_KERNELS}"
    cpu = torch.device("cpu")
    make_linear = linear_factory(cpu, torch.float32, "int8", kernels, None, True) if kernels is not None else None
    model = BertEncoder(gguf, make_linear, INT8_LAYOUT, kernels)
    log.info("embedding model %s: %d dims, pooling %s", gguf, model.dims, model.pooling)
    ready = EngineReady(
        str(folder),
        model_name(config),
        model.context_length,
        model.token.shape[0],
        "cpu",
        "float32",
        kernels=built,
        task="score" if model.scores else "embed",
        dims=model.dims,
    )
    return Embedder(model, config.prefill_chunk), ready


def load_drafter(config: ServerConfig, tokenizer, kernels) -> ModelDrafter:
    """--draft-model: its runner (a GGUF the compact decoder runs, read straight from its file) beside the
    model's, with the same rows and context; a file of another vocabulary stops the start."""

    from ..model.loader import gguf_source, gguf_target, resolve_model_dir
    from ..model.tokenizer import load_tokenizer
    from .model_runner import load_runner
    from .plan import make_plan, model_facts, probe_machine
    from .speculative import ModelDrafter

    draft_config = dataclasses.replace(config, model=config.draft_model, tensor_parallel_size=1)
    gguf = gguf_source(draft_config)
    if gguf is None or not gguf.is_file():
        raise RuntimeError(f"--draft-model {config.draft_model!r}: not a GGUF file")
    plan = make_plan(draft_config, model_facts(gguf, gguf_target(draft_config, gguf)), probe_machine(config.device))
    if plan.model != "compact":
        raise RuntimeError(f"--draft-model {config.draft_model!r}: architecture {plan.arch!r} cannot draft")
    folder = resolve_model_dir(draft_config, weights=False)
    if load_tokenizer(folder).vocab() != tokenizer.vocab():
        raise RuntimeError(
            f"--draft-model {config.draft_model!r}: its vocabulary is not the model's (drafts are token ids)"
        )
    runner = load_runner(draft_config, plan, kernels if plan.cpu_kernels else None, gguf, folder)
    log.info("draft model %s on %s", gguf, plan.describe())
    return ModelDrafter(runner, config.prefill_chunk)


def make_prompt_cache(config: ServerConfig, runner, model, ranks: int = 1) -> PromptCache | None:
    """The prompt cache beyond the rows (None: --cache-ram 0, no prefix cache, or a runner that cannot snapshot
    its rows: a tensor-parallel group's)."""
    from .prompt_cache import PromptCache, cache_bytes, fingerprint

    budget = cache_bytes(config.cache_ram)
    if budget <= 0 or not config.prefix_cache or ranks > 1 or not hasattr(runner, "snapshot"):
        return None
    folder = Path(config.prompt_cache_dir) if config.prompt_cache_dir else None
    cache = getattr(runner, "cache", None)
    if cache is None:  # the mock: its rows hold tokens
        return PromptCache(budget, folder, fingerprint("mock", [config.context_length]))
    layout = [cache.layer_dtypes, cache.length, cache.layer_slots, cache.keys[0].shape[1:], bool(cache.key_scales)]
    return PromptCache(budget, folder, fingerprint(_model_identity(config, model), layout))


def _model_identity(config: ServerConfig, model) -> str:
    """The served model's identity for the prompt cache's files: a GGUF's content digest, a folder's path and
    config."""
    from ..model.loader import content_digest

    path = Path(model)
    if path.is_file():
        return content_digest(path, Path(config.model_cache_dir))
    config_file = path / "config.json"
    return f"{path.resolve()}:{config_file.read_text() if config_file.exists() else ''}"


def decode_graphs(runner) -> tuple[int, ...]:
    """The batch sizes whose decode step the runner replays from CUDA graphs (none: it runs eagerly)."""
    graphs = getattr(runner, "graphs", None)
    return tuple(graphs.captured) if graphs is not None else ()


IDLE_TRIM_AFTER = 0.5  # seconds without work before the engine returns freed memory


def run_engine(config: ServerConfig, inbox, outbox) -> None:
    """Process entry point. Blocks on the inbox while idle; drains it between steps while busy."""
    scheduling_class(web_worker=False)  # (started by the web worker, whose class it inherits)
    die_with_parent()
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s engine %(levelname)s %(message)s")
    from .engine import Engine

    try:
        engine, ready = build_engine(config)
    except Exception as exc:
        log.exception("engine failed to start")
        outbox.put(EngineFailed(str(exc)))
        return
    outbox.put(ready)
    last_stats = None
    while True:
        messages = []
        if not engine.has_work:
            try:
                messages.append(inbox.get(timeout=IDLE_TRIM_AFTER))
            except queue.Empty:  # idle for a while: give freed memory back, then wait
                release_free_memory()
                messages.append(inbox.get())
        try:
            while True:
                messages.append(inbox.get_nowait())
        except queue.Empty:
            pass
        for msg in messages:
            if isinstance(msg, GenerateRequest):
                engine.add(msg)
            elif isinstance(msg, EmbedRequest):
                engine.embed(msg)
            elif isinstance(msg, CancelRequest):
                engine.cancel(msg.session_id)
            elif isinstance(msg, (LoadAdapter, UnloadAdapter)):
                if isinstance(engine, Engine):
                    outbox.put(engine.adapter_message(msg))
                else:  # (an embedding model's engine)
                    outbox.put(AdapterReply(msg.request_id, error="an embedding model takes no LoRA adapters"))
            elif isinstance(msg, Shutdown):
                engine.close()  # (the prompt cache's folder gets the rows' caches)
                close = getattr(engine.runner, "close", None)  # a tensor-parallel group's other ranks
                if close is not None:
                    close()
                return
        events = engine.step() if engine.has_work else []
        stats = engine.stats
        if events or stats != last_stats:
            outbox.put(StepOutput(tuple(events), stats))
            last_stats = stats
