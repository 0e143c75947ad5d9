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


def build_engine(config: ServerConfig) -> tuple[Engine, EngineReady]:
    from ..model_loader import model_name

    if config.mock:
        from ..mock.runner import MockRunner
        from ..mock.tokenizer import EOS, ByteTokenizer

        runner = MockRunner(config.rows, config.mock_tokens_per_second)
        engine = Engine(runner, ByteTokenizer(), config.rows, config.context_length, config.prefill_chunk,
                        frozenset([EOS]), config.test_fault_text, config.prefix_cache)
        return engine, EngineReady("", model_name(config), config.context_length, runner.vocab_size, "cpu", "none")

    import torch

    from ..model_loader import eos_ids, load_model, pick_device, pick_dtype, pick_precision, resolve_model_dir
    from ..tokenizer import HFTokenizer
    from .kernels import load_kernels
    from .model_runner import ModelRunner

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    model_dir = resolve_model_dir(config)
    device = pick_device(config.device)
    model = load_model(model_dir, device, pick_dtype(config.dtype, device))
    precision = pick_precision(config, device, model.dtype)
    kernels = load_kernels(config.model_cache_dir) if device == "cpu" else None
    tokenizer = HFTokenizer(model_dir)
    eos = eos_ids(model, tokenizer.tok)
    runner = ModelRunner(model, config.rows, config.context_length, precision, kernels)
    model_dtype = model.dtype
    dtype = str(model_dtype).removeprefix("torch.")
    del model  # the runner holds its own (packed or quantized) copies of the weights
    kv = str(runner.cache.dtype).removeprefix("torch.")
    batch = str(precision.batch_dtype or model_dtype).removeprefix("torch.")
    vnni = precision.int8_inputs and kernels is not None and kernels.vnni()
    matmuls = "int8" if vnni else batch
    inputs = "every row's inputs int8 (VNNI tiles)" if vnni else "inputs of up to 16 rows " + (
        "int8" if precision.int8_inputs else dtype)
    log.warning("model %s on %s (%s, weights %s, %s layers, multi-row matmuls %s, %s); KV cache %s, "
                "%.0f MiB for %d rows x %d tokens", model_dir, device, dtype, precision.quantize, runner.kind,
                matmuls, inputs, kv, runner.cache.nbytes / 2**20, config.rows, config.context_length)
    engine = Engine(runner, tokenizer, config.rows, config.context_length, config.prefill_chunk, eos,
                    config.test_fault_text, config.prefix_cache)
    ready = EngineReady(str(model_dir), model_name(config), config.context_length, runner.vocab_size, device,
                        dtype, precision.quantize, kv, matmuls, precision.int8_inputs)
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
