"""The engine's LoRA adapters by name: loaded into the runner's slots (at start from ``--lora``, at run time from
``LoadAdapter``), resolved for each request (its ``SamplingParams.lora``: names and scales), and unloaded once no
sequence uses them any more.

A request's adapters become its rows' (slot, scale) pairs, which the runner applies to their tokens, and a tag in
its sequences' namespace (each adapter's content digest and scale), so the prefix cache and the prompt cache never
hand one adapter set's keys and values to another (engine/prefix.py, prompt_cache.py).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .messages import AdapterInfo

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    info: AdapterInfo
    slot: int
    digest: str  # the adapter's content (its files' bytes), for the namespace: a new file under an old name differs
    unloading: bool = False  # unloaded: no new request may use it; its slot is freed when its last sequence ends


def content_digest(path: str) -> str:
    """A digest of an adapter's bytes (a GGUF file, or a PEFT folder's config and weights)."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


class Adapters:
    """The adapters a runner holds (one that has ``add_adapter``: the compact decoder's ModelRunner)."""

    def __init__(self, runner):
        self.runner = runner
        self.loaded: dict[str, Loaded] = {}

    @property
    def infos(self) -> tuple[AdapterInfo, ...]:
        """The adapters requests may name (not those being unloaded)."""
        return tuple(a.info for a in self.loaded.values() if not a.unloading)

    def load(self, name: str, path: str) -> AdapterInfo:
        """Read and hold an adapter under a name not in use. ValueError with the reason (the file's, or the name's)."""
        held = self.loaded.get(name)
        if held is not None:
            why = "being unloaded (its last requests are finishing)" if held.unloading else "loaded already"
            raise ValueError(f"LoRA adapter {name!r} is {why}; unload it first or choose another name")
        slot, adapter = self.runner.add_adapter(name, path)
        info = AdapterInfo(name, str(path), adapter.rank, adapter.alpha, adapter.nbytes)
        self.loaded[name] = Loaded(info, slot, content_digest(path))
        log.info(
            "LoRA adapter %s loaded from %s (rank %d, alpha %g, %d bytes)",
            name,
            path,
            info.rank,
            info.alpha,
            info.bytes,
        )
        return info

    def unload(self, name: str, in_use: Iterable[int]) -> bool:
        """Refuse the adapter to new requests; its slot is freed now if no sequence uses it (``in_use``: the slots of
        every sequence not ended), else when the last one ends (``sweep``). False: no such adapter."""
        held = self.loaded.get(name)
        if held is None or held.unloading:
            return False
        held.unloading = True
        self.sweep(set(in_use))
        return True

    def sweep(self, in_use: set[int]) -> None:
        """Free the slots of unloaded adapters that no sequence uses any more."""
        for name, held in list(self.loaded.items()):
            if held.unloading and held.slot not in in_use:
                self.runner.remove_adapter(held.slot)
                del self.loaded[name]
                log.info("LoRA adapter %s unloaded", name)

    def assign(self, row: int, pairs: tuple[tuple[int, float], ...]) -> None:
        """A row's forwards apply these (slot, scale) pairs from now on (empty: none: the base model's numbers)."""
        self.runner.use_adapters(row, pairs)

    @property
    def pending(self) -> bool:
        """Whether an unloaded adapter still waits for its last sequences."""
        return any(a.unloading for a in self.loaded.values())

    def resolve(self, lora: tuple[tuple[str, float], ...]) -> tuple[tuple[tuple[int, float], ...], str]:
        """A request's adapters as (slot, scale) pairs and its namespace tag. ValueError naming an adapter that is
        not loaded (or being unloaded)."""
        pairs, tag = [], []
        for name, scale in lora:
            held = self.loaded.get(name)
            if held is None or held.unloading:
                known = ", ".join(sorted(a.info.name for a in self.loaded.values() if not a.unloading)) or "none"
                raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {known})")
            if scale == 0.0:  # (llama-server's scale 0: the adapter off for this request)
                continue
            pairs.append((held.slot, float(scale)))
            tag.append(f"{held.digest}*{float(scale)!r}")
        return tuple(pairs), ",".join(tag)
