"""Pre-flight: before loading, check that the weights and the KV cache fit in what is free.

``estimate_bytes`` is the pure arithmetic (parameter count x bytes per weight, KV cache for rows x context);
``preflight`` gathers the model's shape (config.json, safetensors headers or GGUF metadata, never the
weights), the free memory of the chosen device and the free disk for a first GGUF conversion, and raises
``PreflightError`` naming the numbers and the flags that shrink them when something does not fit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import struct
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

from ..config import ServerConfig
from ..model.gguf_meta import read_header
from ..model.loader import folder_spec, gguf_source, gguf_target, read_stamp
from .plan import ExecutionPlan, PlanError, kv_slots, make_plan, model_facts, probe_machine
from .prompt_cache import cache_bytes

log = logging.getLogger(__name__)

GiB = 1 << 30
RUNTIME_OVERHEAD = 1 * GiB  # torch, allocator slack, activations and logits, the web worker
DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}
# bytes per weight of the quantized layouts (kernels/quant.py): int4 packs two weights a byte (q uint8 [N, K/2])
# with a float16 scale d and a float16 minimum m per block of 32; int8 is a byte per weight and one float32 scale
# per group: 32 weights from a GGUF (as Q8_0), one output channel (K weights) from a folder
QUANT_BYTES = {"int4": 0.5 + 4 / 32, "int8": 1.0 + 4 / 32}
VNNI_BYTES = {"int4": 0.5 + 4 / 32, "int8": 1.0 + 4 / 32}  # the weights packed for the tiles
HEAD_BYTES = 1.0 + 4 / 32  # a quantized model's output head: int8 groups of 32 (llama family)
SHRINK_FLAGS = "--rows, --context-length, --dtype, --kv-dtype, --quantize or --cache-ram"
TOKENIZER_DISK = 64 * 2**20  # a GGUF's tokenizer and config files in the model cache, at most


class PreflightError(RuntimeError):
    """The model will not fit; the server must not start."""


@dataclass(frozen=True)
class ModelShape:
    num_params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_params: int = 0  # vocabulary x hidden: the token embedding, and the output head again unless tied
    tied: bool = True  # the output head is the token embedding
    hidden: int = 0
    windows: tuple = ()  # each layer's sliding window (None: the whole context); empty: none slides
    float_params: int = 0  # a GGUF's matrix weights served as float32 (types the kernels lack), whatever the mode
    iq_params: int = 0  # a GGUF's matrix weights of IQ_INT8_TYPES: int8 with the kernels' int8 inputs, else float32


@dataclass(frozen=True)
class Estimate:
    device: str  # "cpu" or "cuda[:N]"
    weights_bytes: int
    kv_cache_bytes: int
    overhead_bytes: int
    free_bytes: int | None  # RAM (cpu) or GPU memory (cuda); None: unknown
    disk_needed_bytes: int  # for a first conversion into the model cache; 0 when already converted
    disk_free_bytes: int | None
    ranks: int = 1  # tensor-parallel ranks: weights_bytes and kv_cache_bytes are each rank's share
    prompt_cache_bytes: int = 0  # the prompt cache beyond the rows, in host memory, at its budget (--cache-ram)

    @property
    def needed_bytes(self) -> int:
        """What must fit in the free memory: one rank's share on its own GPU; on CPU the ranks share the RAM, so
        every rank's share and runtime together, and the prompt cache (host memory)."""
        per_rank = self.weights_bytes + self.kv_cache_bytes + self.overhead_bytes
        if self.device.startswith("cuda"):
            return per_rank
        return per_rank * self.ranks + self.prompt_cache_bytes

    @property
    def memory_kind(self) -> str:
        return "GPU memory" if self.device.startswith("cuda") else "RAM"

    def as_dict(self) -> dict:
        return {**asdict(self), "needed_bytes": self.needed_bytes}

    def summary(self) -> str:
        free = "unknown" if self.free_bytes is None else f"{_gib(self.free_bytes)} free"
        share = (
            ""
            if self.ranks == 1
            else (
                f"{self.ranks} tensor-parallel ranks"
                f"{' sharing it' if not self.device.startswith('cuda') else ''}, each: "
                f"its 1/{self.ranks} of the split layers and the whole embedding and head, "
            )
        )
        text = (
            f"needs {_gib(self.needed_bytes)} of {self.memory_kind} on {self.device} ({share}weights "
            f"{_gib(self.weights_bytes)}, KV cache {_gib(self.kv_cache_bytes)} if every row fills its context, runtime "
            f"{_gib(self.overhead_bytes)}"
            + (f", prompt cache {_gib(self.prompt_cache_bytes)} at most" if self.prompt_cache_bytes else "")
            + f"), {free}"
        )
        if self.disk_needed_bytes:
            text += f"; conversion needs {_gib(self.disk_needed_bytes)} of disk, {_gib(self.disk_free_bytes or 0)} free"
        return text


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def estimate_bytes(
    num_params: int,
    bytes_per_weight: float,
    bytes_per_kv: float | Sequence[float],
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    rows: int,
    context_length: int,
    dense_params: int = 0,
    bytes_per_dense: float = 0.0,
    head_params: int = 0,
    bytes_per_head: float = 0.0,
    windows=(),
    chunk: int = 0,
    vocab_params: int = 0,
    vocab_copies: int = 1,
    ranks: int = 1,
) -> tuple[int, int]:
    """(weights, KV cache) in bytes: ``dense_params`` of the parameters (an untied token embedding, which
    quantization leaves alone) at ``bytes_per_dense``, ``head_params`` (a quantized model's output head) at
    ``bytes_per_head``, the others at ``bytes_per_weight``; keys and values for every layer, row and position
    (plus the cache's one scratch position) at ``bytes_per_kv`` (or each layer's), a sliding-window layer's
    positions as its ring holds them (``windows``: each layer's window, where the plan keeps rings;
    plan.kv_slots). The KV cache is the worst case: on CPU it is lazily resident (anonymous memory), so a server
    whose rows never fill their context uses less. With ``ranks`` tensor-parallel ranks: one rank's share, the
    layers' weights and the KV cache split in ``ranks``, the token embedding and the output head (``vocab_params``
    each, ``vocab_copies`` of them: 1 when tied) whole on every rank."""
    weights = (
        (num_params - dense_params - head_params) * bytes_per_weight
        + dense_params * bytes_per_dense
        + head_params * bytes_per_head
    )
    if ranks > 1:
        replicated = (
            dense_params * bytes_per_dense
            + head_params * bytes_per_head
            + max(0, vocab_params * vocab_copies - dense_params - head_params) * bytes_per_weight
        )
        weights = replicated + (weights - replicated) / ranks
    per_layer = [bytes_per_kv] * num_layers if isinstance(bytes_per_kv, (int, float)) else list(bytes_per_kv)
    slots = kv_slots(windows or (None,) * num_layers, context_length, chunk)
    positions = sum((n + 1) * b for n, b in zip(slots, per_layer))  # (in bytes a value)
    kv = math.ceil(2 * rows * num_kv_heads * positions * head_dim / ranks)
    return math.ceil(weights), kv


def batch_copy_bytes(plan: ExecutionPlan, quantize: str | None = None, head: bool = False) -> float:
    """Bytes per weight of the copies a quantized CPU layer holds beside its weights: the bfloat16 copy it runs
    several rows on where the CPU multiplies bfloat16 fastest (linear.SplitLinear), and the weights packed for
    the tiles (quant.vnni_int4, vnni_int8: the same bytes, int8 with a float scale per 32 at most): counted for
    every weight with AVX512-VNNI, and at the AVX2 level for the head (``head``), whose codes stay beside the
    packing for a tied model's lookups from a folder (the other weights' codes are let go once packed, and so are a
    GGUF's head's on the CPU, whose lookups read its file: an over-estimate there)."""
    quantize = quantize or plan.quantize
    if not plan.cpu_kernels or quantize == "none":
        return 0.0
    packed = plan.vnni or (head and plan.int8_inputs)
    return (DTYPE_BYTES[plan.batch_dtype] if plan.batch_dtype else 0.0) + (VNNI_BYTES[quantize] if packed else 0.0)


def bytes_per_weight(plan: ExecutionPlan, quantize: str | None = None, in_features: int | None = None) -> float:
    """Bytes per weight held as the plan holds them (quantize "none": a dense weight in the plan's dtype).
    ``in_features``: for int8 from a folder, the K weights that share an output channel's scale (None: a GGUF's
    groups of 32)."""
    quantize = quantize or plan.quantize
    copy = batch_copy_bytes(plan, quantize)
    if quantize == "int8" and in_features:
        return 1.0 + 4 / in_features + copy
    if quantize in QUANT_BYTES:
        return QUANT_BYTES[quantize] + copy
    return DTYPE_BYTES[plan.dtype]


def bytes_per_kv(plan: ExecutionPlan, head_dim: int = 64) -> float:
    """Per cached value: an int8 cache adds a float16 scale per head vector of head_dim values."""
    return 1.0 + 2 / head_dim if plan.kv_dtype == "int8" else DTYPE_BYTES[plan.kv_dtype]


def layer_kv_bytes(plan: ExecutionPlan, layers: int, head_dim: int = 64) -> list[float]:
    """Per cached value, each layer's: the plan's, but for the layers of an int8 cache it keeps in float16."""
    return [
        DTYPE_BYTES["float16"] if i in plan.kv_float_layers else bytes_per_kv(plan, head_dim) for i in range(layers)
    ]


# model shapes, from metadata only
def shape_from_config(cfg: dict, num_params: int | None = None) -> ModelShape:
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    if num_params is None:  # a llama-style decoder, counted from its dimensions
        vocab, inter = cfg["vocab_size"], cfg["intermediate_size"]
        per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * inter + 2 * hidden
        num_params = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2) + layers * per_layer + hidden
    return ModelShape(
        num_params,
        layers,
        kv_heads,
        head_dim,
        cfg["vocab_size"] * hidden,
        bool(cfg.get("tie_word_embeddings")),
        hidden,
        _config_windows(cfg),
    )


def _config_windows(cfg: dict) -> tuple:
    from ..model.families import config_windows

    try:
        return config_windows(SimpleNamespace(**cfg))
    except AttributeError:  # no model_type: no architecture the rings apply to
        return ()


def safetensors_params(folder: Path) -> int | None:
    """Parameter count from the safetensors headers (a few kB read per file), or None without safetensors."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def shape_from_header(header: dict) -> ModelShape:
    """A GGUF's shape from its header (gguf_meta.read_header) or its folder's stamp of it."""
    return ModelShape(
        header["num_params"],
        header["num_layers"],
        header["num_kv_heads"],
        header["head_dim"],
        header["vocab_params"],
        header["tied"],
        header["hidden"],
        tuple(header.get("windows") or ()),
        header.get("float_params", 0),
        header.get("iq_params", 0),
    )


def model_shape(config: ServerConfig) -> tuple[ModelShape, int]:
    """The model's shape and the parameters a first conversion into the model cache writes as float32 (for
    transformers' layers; 0 when already converted, or for a folder)."""
    gguf = gguf_source(config)
    if gguf is not None:
        stamp = read_stamp(gguf, gguf_target(config, gguf))
        shape = shape_from_header(stamp or read_header(gguf))
        return shape, 0 if stamp is not None and stamp.get("weights") else shape.num_params
    spec = folder_spec(config)
    if Path(spec).is_dir():
        folder = Path(spec)
    else:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(spec, local_files_only=True, allow_patterns=["*.json"]))
    cfg = json.loads((folder / "config.json").read_text())
    return shape_from_config(cfg.get("text_config", cfg), safetensors_params(folder)), 0


# what is free
def free_memory(device: str) -> int | None:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:  # a container's memory limit (cgroup v2) can be lower than the machine's
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            free = min(free if free is not None else 1 << 62, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


def free_disk(path: Path) -> int | None:
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def model_plan(config: ServerConfig) -> ExecutionPlan:
    """The execution plan the engine will run, from metadata only (plan.py decides it for both)."""
    gguf = gguf_source(config)
    folder: Path | None
    if gguf is not None:
        folder = gguf_target(config, gguf)
    else:
        spec = folder_spec(config)
        folder = Path(spec) if Path(spec).is_dir() else None
    return make_plan(config, model_facts(gguf, folder), probe_machine(config.device))


def estimate(config: ServerConfig) -> Estimate:
    shape, unconverted = model_shape(config)
    plan = model_plan(config)
    gguf = gguf_source(config)
    # a first start from a GGUF writes its tokenizer (and, for transformers' layers, float32 weights)
    prepared = gguf is None or read_stamp(gguf, gguf_target(config, gguf)) is not None
    disk_needed = 0 if prepared else TOKENIZER_DISK + (unconverted * 4 if plan.model == "transformers" else 0)
    per_channel = None if gguf_source(config) is not None else shape.hidden or None
    quantized = plan.quantize != "none"
    compact = plan.model == "compact"
    encoder = plan.model == "encoder"  # (no KV cache, no prompt cache: one forward an input)
    weights, kv = estimate_bytes(
        shape.num_params,
        bytes_per_weight(plan, in_features=per_channel),
        layer_kv_bytes(plan, shape.num_layers, shape.head_dim),
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
        0 if encoder else config.rows,
        config.context_length,
        dense_params=shape.vocab_params if quantized and not shape.tied else 0,
        # (a GGUF's untied token embedding stays in the mapped file on the CPU: gguf_blocks.file_rows)
        bytes_per_dense=0.0 if gguf is not None and plan.device == "cpu" else bytes_per_weight(plan, "none"),
        head_params=shape.vocab_params if quantized and compact else 0,
        bytes_per_head=HEAD_BYTES + batch_copy_bytes(plan, "int8", head=True),
        windows=shape.windows if plan.kv_ring else (),
        chunk=config.prefill_chunk,
        vocab_params=shape.vocab_params,
        vocab_copies=1 if shape.tied else 2,
        ranks=plan.tp,
    )
    # a GGUF's matrices of a type the kernels lack are served dense (gguf_model: dequantized, mode none), not at the
    # mode's bytes
    dense_extra = bytes_per_weight(plan, "none") - bytes_per_weight(plan, in_features=per_channel)
    dense = shape.float_params + (0 if plan.int8_inputs else shape.iq_params)
    weights += math.ceil(dense * max(0.0, dense_extra) / plan.tp)
    if config.draft_model:  # its weights and its own rows' cache beside the model's
        draft = estimate(dataclasses.replace(config, model=config.draft_model, draft_model=None, cache_ram=0))
        weights, kv = weights + draft.weights_bytes, kv + draft.kv_cache_bytes
    weights += adapters_bytes(config, plan)
    return Estimate(
        plan.device,
        weights,
        kv,
        RUNTIME_OVERHEAD,
        free_memory(plan.device),
        disk_needed,
        free_disk(config.model_cache_dir) if disk_needed else None,
        plan.tp,
        cache_bytes(config.cache_ram) if config.prefix_cache and plan.tp == 1 and not encoder else 0,
    )


def adapters_bytes(config: ServerConfig, plan: ExecutionPlan) -> int:
    """--lora's adapters as the decoder holds them: their numbers (from the files' headers) in float16 where the
    CPU kernels add their terms, else in the model's dtype."""
    from ..model.lora_files import adapter_params, adapter_specs

    numbers = sum(adapter_params(path) for _, path in adapter_specs(config.lora))
    return int(numbers * (2.0 if plan.cpu_kernels else DTYPE_BYTES.get(plan.dtype, 4.0)))


def served_architectures(arch: str | None = None) -> tuple[str, ...]:
    """The GGUF architectures this server runs: the family table's (the compact decoder), the embedding models'
    (ENCODERS) and those transformers reads from a GGUF (its layers). With ``arch``: just (arch,) when
    the first two hold it (transformers, a second's import, is read only for an architecture they do not)."""
    from ..model.families import ENCODERS, FAMILIES

    known = {f.gguf for f in FAMILIES.values() if f.gguf} | set(ENCODERS)
    if arch in known:
        return (arch,)
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    known |= {a for a in GGUF_CONFIG_MAPPING if a not in ("general", "tokenizer")}
    return tuple(sorted(known))


def check_servable(config: ServerConfig) -> None:
    """PreflightError, with the reason and what is supported, for a GGUF whose architecture or tokenizer this
    server does not know: refused at once (not with --skip-preflight either), never an engine that fails while
    the server stays up."""
    from ..model.gguf_meta import GGUFIndex
    from ..model.gguf_vocab import TOKENIZERS

    gguf = gguf_source(config)
    if gguf is None or not gguf.is_file():
        return  # (the loader reports a missing file; a model folder is read by transformers)
    try:
        fields = GGUFIndex(gguf).fields
    except Exception as exc:
        raise PreflightError(f"{gguf} is not a GGUF file this server can read: {exc}") from None
    arch, tokenizer = fields.get("general.architecture"), fields.get("tokenizer.ggml.model")
    known = served_architectures(arch)
    if arch not in known:
        raise PreflightError(f"{gguf}: architecture {arch!r} is not supported; supported: {', '.join(known)}")
    if tokenizer is not None and tokenizer not in TOKENIZERS:
        raise PreflightError(
            f"{gguf}: tokenizer {tokenizer!r} is not supported; supported: {', '.join(TOKENIZERS)} (BPE, SPM, WPM)"
        )


def preflight(config: ServerConfig) -> Estimate | None:
    """The estimate (logged); PreflightError when it does not fit, unless --skip-preflight."""
    if config.mock:
        return None
    try:
        est = estimate(config)
    except PlanError as exc:  # the flags cannot be met (the engine would refuse the same): not a memory question
        raise PreflightError(f"pre-flight: {exc}") from None
    except Exception as exc:  # the loader will report a missing or broken model properly
        log.warning("pre-flight skipped: cannot read the model's shape (%s)", exc)
        return None
    problems = []
    if est.free_bytes is not None and est.needed_bytes > est.free_bytes:
        problems.append(f"{_gib(est.needed_bytes)} of {est.memory_kind} needed, {_gib(est.free_bytes)} free")
    if est.disk_free_bytes is not None and est.disk_needed_bytes > est.disk_free_bytes:
        problems.append(
            f"{_gib(est.disk_needed_bytes)} of disk needed in {config.model_cache_dir} for the "
            f"conversion, {_gib(est.disk_free_bytes)} free"
        )
    if not problems:
        print(f"pre-flight: {est.summary()}", file=sys.stderr, flush=True)
        return est
    message = (
        f"pre-flight: the model does not fit: {'; '.join(problems)} ({est.summary()}; "
        f"{config.rows} rows x {config.context_length} tokens). Shrink it with {SHRINK_FLAGS}, "
        f"or pass --skip-preflight to start anyway."
    )
    if config.skip_preflight:
        print(f"WARNING: {message} Starting anyway (--skip-preflight).", file=sys.stderr, flush=True)
        return est
    raise PreflightError(message)
