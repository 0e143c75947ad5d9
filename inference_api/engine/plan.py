"""The execution plan: device, dtypes, KV cache type, kernels and model kind, decided once and read everywhere.

``make_plan`` is pure: it takes the flags, a few facts about the model (its architecture, whether it is a
GGUF and the quantization of its linears) and a few facts about the machine (CPU flags, CUDA), and returns
the one ``ExecutionPlan`` that pre-flight sizes, the engine process loads, the runner allocates the KV cache
by and the layers pick their kernels from. Nothing else decides any of these, so pre-flight's figures and
what the engine allocates cannot drift apart. ``probe_machine`` and ``model_facts`` gather the facts
(reading /proc/cpuinfo, asking torch for CUDA only where a driver is present, reading model metadata only).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from ..config import ServerConfig
from ..kernels import LEVELS, cpu_flags
from ..model.gguf_meta import IQ_INT8_TYPES

if TYPE_CHECKING:
    import torch


def kv_slots(windows: Sequence[int | None], length: int, chunk: int) -> list[int]:
    """Each layer's KV positions per row (besides its scratch slot): a sliding-window layer's ring of window +
    chunk (the most tokens one forward writes into a row: a prefill chunk's queries still read the window before
    it) where that is shorter than the context, else the context's length. windows: each layer's window or
    None; the engine allocates these and pre-flight counts them."""
    return [w + chunk if w and w + chunk < length else length for w in windows]


@dataclass(frozen=True)
class Machine:
    cpu_flags: frozenset[str] = frozenset()
    cuda: bool = False  # a CUDA device torch can use
    cuda_bf16: bool = False  # that device multiplies bfloat16


@dataclass(frozen=True)
class ModelFacts:
    arch: str  # transformers' model_type ("llama", "gemma3_text", ...); "" when unknown
    gguf: bool = False  # the weights come from a GGUF file
    gguf_quantize: str = "none"  # the weight-only mode that keeps the GGUF's own linears: none | int8 | int4
    gguf_types: tuple[str, ...] = ()  # the GGUF's matrices' tensor types, most bytes first
    config: dict[str, Any] | None = field(
        default=None, compare=False
    )  # a folder's config.json: its options are checked
    heads: int = 0  # attention heads (0: unknown)
    kv_heads: int = 0  # key/value heads (0: unknown)
    key_outliers: tuple[int, ...] = ()  # a GGUF's layers whose keys carry outlier channels (gguf_meta.key_outliers)


# the GGUF block types served in quant.py's int8 layout where the kernels take int8 inputs (ExecutionPlan.int8_layout)
INT8_LAYOUT = frozenset({"Q8_0"} | IQ_INT8_TYPES)


@dataclass(frozen=True)
class ExecutionPlan:
    """How the engine runs the model. dtype names are torch's without the prefix ("float32")."""

    device: str  # cpu | cuda | cuda:N
    dtype: str  # activations and the weights that stay dense
    quantize: str = "none"  # none | int8 | int4: the linears' weights
    group: int | None = None  # int8 scale group: 32 for a GGUF's blocks (as Q8_0), None: one per output channel
    kv_dtype: str = "float32"
    kv_float_layers: tuple[int, ...] = ()  # layers of an int8 cache kept in float16 (their keys' outlier channels)
    batch_dtype: str | None = None  # a oneDNN copy the CPU's quantized linears run several rows on (None: none)
    int8_inputs: bool = False  # the CPU kernels round every row's inputs to int8 blocks, as llama.cpp does
    vnni: bool = False  # ... and every row count's, through the AVX512-VNNI tiles over weights packed at load
    cpu_kernels: bool = False  # the compiled CPU kernels run norms, rotary, attention and quantized linears
    cpu_level: str | None = None  # the kernels' level (LEVELS) when one is asked for; None: built for this CPU
    # compact (model/compact.py, described by model/families.py) | transformers | encoder (model/encoder.py: an
    # embedding model or a reranker, one forward an input, no KV cache)
    model: str = "compact"
    arch: str = ""
    gguf_types: tuple[str, ...] = ()  # a GGUF's tensor types the compact model serves in their own blocks
    tp: int = 1  # tensor-parallel ranks (processes) the compact model's heads and MLP columns are split over
    cuda_graphs: bool = False  # the compact model's decode step replayed from CUDA graphs (engine/cuda_graphs.py)

    @property
    def int8_layout(self) -> frozenset[str]:
        """The GGUF block types served in quant.py's int8 layout instead of their own blocks: wherever the kernels
        take int8 inputs, Q8_0 (the embedding and tied head, the largest tensor of a small model: 72 % of Gemma 3
        270M's bytes a token; and Q8_0 linears). Not Q5_0 nor IQ4_NL: both levels pack their blocks at load for
        their tiles (B32Pack: 22 and 18 bytes a row and block against the layout's 36; at the AVX-512 level SmolLM2
        Q4_K_M's one-row step 5.3 against 6.9 ms, Gemma 3's 11.6 against 12.7, its 32-row step 43.8 against 40.7,
        minimums of 3 alternating runs, 2026-11-27 19:50). The tiles of both levels run the
        layout packed at load (quant.vnni_int8; VNNI: 7.3 against 12.0 ms at one row of Gemma's head, 32.5 against
        42.6 at 32, SmolLM2's Q8_0 linears 7.4 against 9.9 ms a decode step, AMD EPYC with AVX-512, 2026-11-25; AVX2:
        avx2_i8_tile over the same packing, docs/performance.md), the unpacked codes let go except for a tied head's
        embedding rows. And the i-quants (IQ_INT8_TYPES: blocks of 32 int8 codes times a scale, or rounded so where
        they scale blocks of 16), which have no tiles of their own (float32 else: four times the bytes)."""
        if not self.int8_inputs:
            return frozenset()
        return INT8_LAYOUT

    @property
    def matmul_dtype(self) -> str:
        """What several rows' matmuls run in: int8 with int8 inputs (the VNNI tiles, or AVX2 tiles and integer row
        kernels), a oneDNN copy's dtype, else the model's."""
        return "int8" if self.vnni or self.int8_inputs else self.batch_dtype or self.dtype

    @property
    def kv_ring(self) -> bool:
        """Sliding-window layers keep a ring of window + prefill chunk positions per row instead of the whole
        context: where the compact model's attention runs on the CPU kernels (they read a window across the ring's
        wrap; SDPA and transformers' layers read a row's first positions)."""
        return self.cpu_kernels and self.model == "compact"

    @overload
    def torch(self, name: str) -> torch.dtype: ...
    @overload
    def torch(self, name: None) -> None: ...
    @overload
    def torch(self, name: str | None) -> torch.dtype | None: ...
    def torch(self, name: str | None) -> torch.dtype | None:
        """A dtype name of this plan as torch's dtype (None stays None)."""
        import torch

        if name is None:
            return None
        dtype: torch.dtype = getattr(torch, name)
        return dtype

    def without_cpu_kernels(self) -> ExecutionPlan:
        """The plan when the kernels cannot be compiled here: quantized weights are served dequantized."""
        return replace(self, cpu_kernels=False, int8_inputs=False, vnni=False, gguf_types=())

    def describe(self) -> str:
        inputs = (
            "every row's inputs int8 (VNNI tiles)"
            if self.vnni
            else "every row's inputs int8 (AVX2 tiles)"
            if self.int8_inputs
            else f"inputs {self.dtype}"
        )
        kind = f"{self.arch} {self.model} layers" if self.arch else f"{self.model} layers"
        weights = f"the GGUF's own blocks ({', '.join(self.gguf_types)})" if self.gguf_types else self.quantize
        ranks = f", split over {self.tp} ranks" if self.tp > 1 else ""
        graphs = ", decode step in CUDA graphs" if self.cuda_graphs else ""
        floats = f" (layers {', '.join(map(str, self.kv_float_layers))} float16)" if self.kv_float_layers else ""
        return (
            f"{self.device} ({self.dtype}, weights {weights}, {kind}, multi-row matmuls "
            f"{self.matmul_dtype}, {inputs}, KV cache {self.kv_dtype}{floats}{ranks}{graphs})"
        )


class PlanError(ValueError):
    """The flags ask for something this model or machine cannot run (the message names the flag)."""


def tp_refusal(size: int, heads: int, kv_heads: int) -> str | None:
    """Why the model's heads cannot be split over ``size`` tensor-parallel ranks, or None when they can (0: a count
    not known yet). Every rank takes heads / size query heads and kv_heads / size key/value heads."""
    if size < 1:
        return f"--tensor-parallel-size must be at least 1 (got {size})"
    bad = [f"{n} {what}" for n, what in ((heads, "attention heads"), (kv_heads, "key/value heads")) if n and n % size]
    if bad:
        return (
            f"--tensor-parallel-size {size}: the model's {' and '.join(bad)} do not divide by {size} "
            f"(each rank takes an equal share of the heads)"
        )
    return None


def make_plan(config: ServerConfig, model: ModelFacts, machine: Machine) -> ExecutionPlan:
    """The plan for these flags, this model and this machine. Pure. PlanError where the flags cannot be met."""
    from ..model.families import supported

    device = config.device if config.device != "auto" else "cuda" if machine.cuda else "cpu"
    cuda = device.startswith("cuda")
    tp = config.tensor_parallel_size
    compact = supported(model.arch, model.config, model.gguf)
    if tp != 1:
        refusal = tp_refusal(tp, model.heads, model.kv_heads)
        if refusal is None and not compact and model.arch:  # (unknown before a hub model's folder is found)
            refusal = (
                f"--tensor-parallel-size {tp}: architecture {model.arch or 'unknown'!r} runs on transformers' "
                f"layers, which cannot be split; only the compact decoder's architectures shard"
            )
        if refusal is None and cuda:
            refusal = (
                f"--tensor-parallel-size {tp}: the ranks run on CPU (gloo) in this version; pass --device cpu "
                f"or --tensor-parallel-size 1 on {device}"
            )
        if refusal is not None:
            raise PlanError(refusal)
    if config.dtype != "auto":
        dtype = config.dtype
    else:  # CPU: float32 is the fast and exact choice for small models
        dtype = ("bfloat16" if machine.cuda_bf16 else "float16") if cuda else "float32"
    if config.quantize != "auto":
        quantize = config.quantize
    else:  # auto keeps a GGUF file's own quantization; a folder is served as it is
        quantize = model.gguf_quantize if model.gguf and config.dtype in ("auto", "float32") else "none"
    quantized_cpu = quantize != "none" and device == "cpu"
    # next to quantized weights on CPU the compact model holds its KV cache in int8 (each head vector in 127 steps
    # of its own scale), but for the layers whose keys carry outlier channels (a key bias far above the rest, as
    # Qwen2.5's first layers: they lose every other channel to the one scale), which keep float16. Qwen2.5-Coder
    # 1.5B Q4_K_M: perplexity 1.86 % below llama-perplexity's with every layer's keys int8, +0.04 % with its 4
    # such layers float16 (docs/backend.md). transformers' layers cannot read either, so they keep the model's dtype
    float_layers: tuple[int, ...] = ()
    if config.kv_dtype != "auto":
        kv = config.kv_dtype if compact else dtype
    elif quantized_cpu and compact:
        kv, float_layers = "int8", model.key_outliers
    else:
        kv = dtype
    flags = machine.cpu_flags
    level = None if config.cpu_level == "auto" else config.cpu_level
    if level is not None and device == "cpu":  # decided as on a CPU with this level's instructions alone
        needs = LEVELS[level][1]
        if not needs <= flags:
            raise PlanError(
                f"--cpu-level {level}: this CPU lacks {', '.join(sorted(needs - flags))} (it runs "
                f"{', '.join(name for name, (_, n) in LEVELS.items() if n <= flags) or 'neither level'})"
            )
        flags = needs
    # several rows on a bfloat16 copy only where the CPU multiplies bfloat16 but has no AVX512-VNNI: the VNNI
    # tiles compute each row the same whatever the batch (batch-invariant answers), hold no copy, and on the
    # AMX Xeon of 2026-11-24 ran a 32-row decode step in 41 ms against the AMX bfloat16 copy's 51 (prefill
    # 1.3x slower); Zen 4 (AVX512-BF16 and VNNI, 2026-11-24): 0.6 of bfloat16's time
    bf16 = ("amx_bf16" in flags or "avx512_bf16" in flags) and "avx512_vnni" not in flags
    cpu_kernels = device == "cpu" and dtype == "float32"
    # a generating model's token vectors (--embedding) keep float inputs: with every row's inputs rounded to int8
    # the embedded file's mean-pooled vectors were 0.9990 to 0.99999 (cosine) of llama-server --embedding's, with
    # float inputs 0.9992 to 0.9999 (the bound asked is 0.999), at half the texts a second (3x llama-server's)
    rounded = quantized_cpu and config.dtype == "auto" and not config.embedding
    int8_inputs = rounded and cpu_kernels
    return ExecutionPlan(
        device=device,
        dtype=dtype,
        quantize=quantize,
        group=32 if model.gguf else None,
        kv_dtype=kv,
        kv_float_layers=float_layers,
        batch_dtype="bfloat16" if rounded and bf16 else None,
        int8_inputs=int8_inputs,
        vnni=int8_inputs and "avx512_vnni" in flags,
        cpu_kernels=cpu_kernels,
        cpu_level=level if cpu_kernels else None,
        model="compact" if compact else "encoder" if is_encoder(model.arch) else "transformers",
        arch=model.arch,
        gguf_types=model.gguf_types if compact and quantized_cpu and cpu_kernels else (),
        tp=tp,
        cuda_graphs=cuda and compact and config.cuda_graphs,
    )


# the facts, gathered
def probe_machine(device: str = "auto") -> Machine:
    """The machine's facts; torch is imported only where CUDA can matter (a driver is present, or asked for)."""
    wants_cuda = device.startswith("cuda") or (
        device == "auto" and (Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi"))
    )
    if not wants_cuda:
        return Machine(cpu_flags())
    import torch

    cuda = torch.cuda.is_available()
    return Machine(cpu_flags(), cuda, cuda and torch.cuda.is_bf16_supported())


def is_encoder(arch: str) -> bool:
    """Whether an architecture (a GGUF's, as ModelFacts has it) runs on model/encoder.py."""
    from ..model.families import ENCODERS

    return arch in ENCODERS


def model_facts(gguf: Path | None, folder: Path | None) -> ModelFacts:
    """Facts from metadata only: for a GGUF, its folder's stamp when the folder holds its conversion, else the
    file's header; for a folder, its config.json."""
    if gguf is None:
        try:
            cfg = json.loads((folder / "config.json").read_text()) if folder is not None else {}
        except (OSError, ValueError):
            cfg = {}
        text = cfg.get("text_config", cfg)
        heads = text.get("num_attention_heads") or 0
        return ModelFacts(
            cfg.get("model_type", ""), config=cfg, heads=heads, kv_heads=text.get("num_key_value_heads") or heads
        )
    from ..model.families import model_type
    from ..model.gguf_meta import read_header
    from ..model.loader import read_stamp

    header = (read_stamp(gguf, folder) if folder is not None else None) or read_header(gguf)
    heads = header.get("heads")
    if heads is None and folder is not None:  # a stamp of an earlier conversion: its folder's config.json
        try:
            heads = json.loads((folder / "config.json").read_text()).get("num_attention_heads")
        except (OSError, ValueError):
            heads = None
    return ModelFacts(
        model_type(header["arch"]),
        True,
        header["quantize"],
        tuple(header.get("types", ())),
        heads=heads or 0,
        kv_heads=header.get("num_kv_heads") or heads or 0,
        key_outliers=tuple(header.get("key_outliers", ())),
    )
