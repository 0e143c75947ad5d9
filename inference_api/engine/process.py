"""The backend process: build the engine, then loop: read requests, step, push outputs."""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading

from ..config import ServerConfig
from ..messages import (CancelRequest, EngineFailed, EngineReady, GenerateRequest, Shutdown, StepOutput)
from .engine import Engine

log = logging.getLogger(__name__)


def _engine(config: ServerConfig, *args, **kwargs) -> Engine:
    if config.test_fault_text:
        from .faults import FaultyEngine

        return FaultyEngine(*args, fault_text=config.test_fault_text, **kwargs)
    return Engine(*args, **kwargs)


def release_freed_memory() -> None:
    """Hand the memory freed by loading back to the system: parsing a GGUF's metadata (Gemma 3's 262,144-token
    vocabulary: about 0.6 GB of Python objects) and its tokenizer leave freed pages that glibc keeps; trimmed,
    the engine of Gemma 3 270M holds 0.69 GB instead of 0.81 after its start (docs/performance.md)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def build_engine(config: ServerConfig) -> tuple[Engine, EngineReady]:
    from ..model_loader import model_name

    if config.mock:
        from ..mock.runner import MockRunner
        from ..mock.tokenizer import EOS, ByteTokenizer

        runner = MockRunner(config.rows, config.mock_tokens_per_second)
        engine = _engine(config, runner, ByteTokenizer(), config.rows, config.context_length, config.prefill_chunk,
                         frozenset([EOS]), prefix_cache=config.prefix_cache)
        return engine, EngineReady("", model_name(config), config.context_length, runner.vocab_size, "cpu", "none")

    import torch

    from ..model_loader import eos_ids, gguf_source, gguf_target, load_model, resolve_model_dir
    from ..plan import make_plan, model_facts, probe_machine
    from ..tokenizer import HFTokenizer
    from .constrain import for_hf_tokenizer
    from .gguf_model import GGUFModel
    from .kernels import load_kernels
    from .model_runner import ModelRunner

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    gguf = gguf_source(config)
    folder = gguf_target(config, gguf) if gguf is not None else resolve_model_dir(config)
    plan = make_plan(config, model_facts(gguf, folder), probe_machine(config.device))
    kernels = load_kernels(config.model_cache_dir) if plan.cpu_kernels else None
    if plan.cpu_kernels and kernels is None:
        plan = plan.without_cpu_kernels()
    # a GGUF of a described architecture is read straight from its file; anything else through transformers
    direct = gguf is not None and plan.model == "compact"
    model_dir = resolve_model_dir(config, weights=not direct) if gguf is not None else folder
    dtype = plan.torch(plan.dtype)
    model = GGUFModel(gguf, plan.device, dtype) if direct else load_model(model_dir, plan.device, dtype)
    tokenizer = HFTokenizer(model_dir)
    eos = eos_ids(model_dir, tokenizer.tok)
    runner = ModelRunner(model, config.rows, config.context_length, plan, kernels, config.prefill_chunk)
    del model  # the runner holds its own (packed or quantized) copies of the weights
    release_freed_memory()
    if plan.model != "compact":
        log.warning("architecture %r is not described for the compact decoder: it runs on transformers' layers "
                    "(correct, slower)", plan.arch)
    rings = sorted({n for n in runner.cache.layer_slots if n < config.context_length})
    log.info("model %s on %s; KV cache %.0f MiB for %d rows x %d tokens%s", model_dir, plan.describe(),
             runner.cache.nbytes / 2**20, config.rows, config.context_length,
             f" (sliding-window layers in rings of {', '.join(map(str, rings))})" if rings else "")
    engine = _engine(config, runner, tokenizer, config.rows, config.context_length, config.prefill_chunk, eos,
                     prefix_cache=config.prefix_cache,
                     constraints=for_hf_tokenizer(tokenizer.tok, runner.vocab_size, eos))
    ready = EngineReady(str(model_dir), model_name(config), config.context_length, runner.vocab_size, plan.device,
                        plan.dtype, plan.quantize, plan.kv_dtype, plan.matmul_dtype, plan.int8_inputs)
    return engine, ready


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """End this process as soon as the web worker that started it ends, however it ends, busy or idle.

    Two independent guards: Linux's parent-death signal (SIGKILL from the kernel when the parent goes), and a
    thread that waits on multiprocessing's parent sentinel, a pipe that reaches EOF when the parent is gone.
    Signals sent to the whole process group (Ctrl-C, ``kill -TERM -pgid``) are ignored: the worker drains first
    and then stops the engine itself.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            log.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent pipe")
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return
    if not parent.is_alive():  # the parent died before the guards were in place
        os._exit(0)

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


IDLE_TRIM_AFTER = 0.5  # seconds without work before the engine returns freed memory


def release_free_memory() -> None:
    """Hand memory the process no longer uses back to the system: start-up's temporaries, and the buffers of
    past steps that the C allocator keeps (glibc's malloc_trim, which runs without the GIL; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def run_engine(config: ServerConfig, inbox, outbox) -> None:
    """Process entry point. Blocks on the inbox while idle; drains it between steps while busy."""
    die_with_parent()
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s engine %(levelname)s %(message)s")
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
            elif isinstance(msg, CancelRequest):
                engine.cancel(msg.session_id)
            elif isinstance(msg, Shutdown):
                return
        events = engine.step() if engine.has_work else []
        stats = engine.stats
        if events or stats != last_stats:
            outbox.put(StepOutput(tuple(events), stats))
            last_stats = stats
