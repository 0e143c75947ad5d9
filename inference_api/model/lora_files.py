"""A LoRA adapter's files as pre-flight and the engine's start read them before any weight is loaded: the ``--lora``
entries and the numbers an adapter's headers declare. Apart from model/lora.py (which holds the adapters' tensors)
so that gunicorn's first process reads them without importing torch."""

from __future__ import annotations

import json
import math
from pathlib import Path

GGUF_MAGIC = b"GGUF"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def adapter_specs(entries) -> list[tuple[str, str]]:
    """(name, path) of each ``--lora`` entry: ``NAME=PATH``, or a bare PATH named by its file's stem or its
    folder's name."""
    specs = []
    for entry in entries:
        name, sep, path = str(entry).partition("=")
        if not sep:
            name, path = Path(entry).stem if Path(entry).suffix == ".gguf" else Path(entry).name, str(entry)
        if not name or not path:
            raise ValueError(f"--lora {entry!r}: expected NAME=PATH or a path")
        specs.append((name, path))
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora: the adapter name {next(n for n in names if names.count(n) > 1)!r} is given twice")
    return specs


def adapter_params(path: str | Path) -> int:
    """The numbers an adapter holds, from its headers (pre-flight: its bytes in the model's dtype); 0 where the
    path is neither format (loading it then says why)."""
    p = Path(path)
    if p.is_dir():
        weights = p / PEFT_WEIGHTS
        if not weights.is_file():
            return 0
        with open(weights, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    try:
        from .gguf_meta import GGUFIndex

        return sum(math.prod(int(n) for n in t.shape) for t in GGUFIndex(p).tensors)
    except Exception:
        return 0
