"""The prompt cache beyond the rows: the keys and values of conversations whose rows were taken by others, kept in
host memory (and, with a folder, on disk) and restored into a free row instead of being computed again, as
llama-server's ``--cache-ram`` and ``--slot-save-path``, SGLang's HiCache and vLLM's CPU offload keep more than
the GPU's (here: the rows') cache holds.

A row's cache is saved as it is about to be written over (``Scheduler.admit`` gives the engine the row, its
namespace and its tokens): a snapshot of every layer's positions (a sliding-window layer's ring as it is, valid
for exactly the positions its row had written, which ``RowKVCache.holds`` then checks as for a row). Entries are
found by the longest common prefix of a new prompt with their tokens, within the prompt's namespace only (its team
and cache salt: the prefix cache's privacy), and kept least recently used first out within ``--cache-ram`` bytes.

On disk (``--prompt-cache-dir``) every entry is a file written beside the memory tier, read back at start (only
its header: the tokens and namespace; the tensors when it is hit), and checked: a file whose version or model
fingerprint (the model file's digest, the cache's layout and dtype) differs, or whose contents do not match their
SHA-256, is set aside with a warning and never served. At shutdown the rows' own caches are saved too, so a
restart finds them.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .prefix import common_prefix

if TYPE_CHECKING:  # (torch is imported where tensors are handled: pre-flight reads cache_bytes without it)
    import torch

log = logging.getLogger(__name__)

MAGIC = b"IAPC"  # inference_api prompt cache
# the files' format and the numbers they hold: bumped when a model's weights are served in other forms (2: the
# i-quants of few levels with float32 block scales and exact untied token embeddings, 2026-11-29)
VERSION = 2
MIN_TOKENS = 64  # shorter caches are not worth a snapshot: computing them again is as quick
SUFFIX = ".kvc"
STALE_TMP_S = 3600  # a file being written older than this was left by a writer that died: swept at start


@dataclass
class Entry:
    namespace: Hashable
    tokens: tuple[int, ...]  # the tokens at positions 0.. whose keys and values it holds
    tensors: list[torch.Tensor] | None  # the row's stores (RowKVCache.snapshot); None: on disk only, not loaded
    nbytes: int
    path: Path | None = None  # its file, with a folder


def _plain(namespace: Hashable):
    """A namespace as JSON writes it (a tuple as a list)."""
    return list(namespace) if isinstance(namespace, tuple) else namespace


def _key(namespace: Hashable, tokens: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([_plain(namespace), list(tokens)]).encode()).hexdigest()[:32]


class PromptCache:
    def __init__(self, budget_bytes: int, folder: Path | None = None, fingerprint: str = "", disk_bytes: int = 0):
        self.budget = budget_bytes
        self.folder = folder
        self.fingerprint = fingerprint
        self.disk_budget = disk_bytes or 4 * budget_bytes
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self.resident = 0  # bytes of the entries' tensors in memory
        self.saved = self.restored = 0  # entries saved and restored, ever
        self._writes: list[threading.Thread] = []
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self._scan()

    # lookups (the scheduler's; no tensors touched)
    def longest(self, prompt: Sequence[int], namespace: Hashable, limit: int) -> tuple[str | None, int]:
        """(key, length) of the entry of the namespace whose tokens share the longest prefix with prompt, at
        most limit tokens; (None, 0) if none."""
        best, length = None, 0
        for key, entry in self.entries.items():
            if entry.namespace != namespace or len(entry.tokens) <= length or entry.tokens[:1] != tuple(prompt[:1]):
                continue
            n = common_prefix(prompt, entry.tokens)
            if n > length:
                best, length = key, n
        return best, min(length, limit)

    def tokens_of(self, key: str) -> tuple[int, ...]:
        return self.entries[key].tokens

    def needs(self, namespace: Hashable, tokens: Sequence[int]) -> bool:
        """Whether saving these tokens' cache would add to what is kept (long enough, and no entry of the
        namespace holds them all already)."""
        tokens = tuple(tokens)
        if len(tokens) < MIN_TOKENS:
            return False
        return not any(e.namespace == namespace and e.tokens[: len(tokens)] == tokens for e in self.entries.values())

    # what the engine does with the tensors
    def save(self, namespace: Hashable, tokens: Sequence[int], tensors: list[torch.Tensor]) -> None:
        """Keep a row's snapshot; an entry whose tokens it extends is replaced, one that extends it makes it
        needless."""
        tokens = tuple(tokens)
        if not self.needs(namespace, tokens):
            return
        for key, entry in list(self.entries.items()):
            if entry.namespace == namespace and tokens[: len(entry.tokens)] == entry.tokens:
                self._drop(key)  # (it extends that entry)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if nbytes > self.budget:
            return
        key = _key(namespace, tokens)
        entry = Entry(namespace, tokens, tensors, nbytes)
        self.entries[key] = entry
        self.resident += nbytes
        self.saved += 1
        self._fit()
        if self.folder is not None:
            entry.path = self.folder / f"{key}{SUFFIX}"
            self._write_async(entry)

    def load(self, key: str) -> list[torch.Tensor] | None:
        """An entry's tensors (read from its file when only there; None, and the entry dropped, when the file
        fails its checks)."""
        entry = self.entries[key]
        self.entries.move_to_end(key)
        if entry.tensors is None:
            tensors = self._read(entry)
            if tensors is None:
                self._drop(key)
                return None
            entry.tensors = tensors
            self.resident += entry.nbytes
            self._fit(keep=key)
        self.restored += 1
        return entry.tensors

    def flush(self) -> None:
        """Wait for the files being written."""
        for t in self._writes:
            t.join()
        self._writes.clear()

    @property
    def nbytes(self) -> int:
        return self.resident

    # the budget
    def _fit(self, keep: str | None = None) -> None:
        """Drop (from memory; with a folder an entry stays on disk) the least recently used until within budget."""
        for key in list(self.entries):
            if self.resident <= self.budget:
                break
            entry = self.entries[key]
            if key == keep or entry.tensors is None:
                continue
            self.resident -= entry.nbytes
            if entry.path is not None:
                entry.tensors = None  # on disk still
            else:
                del self.entries[key]
        if self.folder is not None:
            self._fit_disk()

    def _fit_disk(self) -> None:
        on_disk = [(k, e) for k, e in self.entries.items() if e.path is not None]
        total = sum(e.nbytes for _, e in on_disk)
        for key, entry in on_disk:
            if total <= self.disk_budget:
                break
            total -= entry.nbytes
            if entry.tensors is None:
                self._drop(key)
            else:
                self._unlink(entry)

    def _drop(self, key: str) -> None:
        entry = self.entries.pop(key)
        if entry.tensors is not None:
            self.resident -= entry.nbytes
        self._unlink(entry)

    def _unlink(self, entry: Entry) -> None:
        if entry.path is not None:
            path, entry.path = entry.path, None
            try:
                path.unlink()
            except OSError:
                pass

    # files: MAGIC, version, header length, header (JSON: fingerprint, namespace, tokens, tensor shapes and dtypes,
    # the payload's SHA-256), payload (the tensors' bytes one after another)
    def _write_async(self, entry: Entry) -> None:
        tensors = entry.tensors
        if tensors is None or entry.path is None:
            return
        self._writes = [t for t in self._writes if t.is_alive()]
        t = threading.Thread(target=self._write, args=(entry.path, entry.namespace, entry.tokens, tensors), daemon=True)
        self._writes.append(t)
        t.start()

    def _write(self, path: Path, namespace: Hashable, tokens: tuple[int, ...], tensors: list[torch.Tensor]) -> None:
        import torch

        try:
            payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
            header = json.dumps(
                {
                    "fingerprint": self.fingerprint,
                    "namespace": _plain(namespace),
                    "tokens": list(tokens),
                    "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors],
                    "sha256": hashlib.sha256(payload).hexdigest(),
                }
            ).encode()
            # each writer its own: two servers on one folder, or two saves of one entry, never write one file
            tmp = path.with_name(f"{path.stem}.{os.getpid()}-{uuid.uuid4().hex}.tmp")
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<II", VERSION, len(header)) + header + payload)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("prompt cache: could not write %s: %s", path, exc)

    @staticmethod
    def _header(f: io.BufferedReader) -> dict | None:
        head = f.read(12)
        if len(head) < 12 or head[:4] != MAGIC:
            return None
        version, length = struct.unpack("<II", head[4:])
        if version != VERSION:
            return None
        return json.loads(f.read(length))

    def _scan(self) -> None:
        """The folder's entries of this model and cache layout, headers only (oldest first); files a dead writer
        left half-written are swept."""
        assert self.folder is not None
        for tmp in self.folder.glob("*.tmp"):
            try:
                if time.time() - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink()
            except OSError:  # (another start swept it first)
                pass
        files = sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                with open(path, "rb") as f:
                    header = self._header(f)
            except (OSError, ValueError) as exc:
                header = None
                log.warning("prompt cache: %s unreadable (%s); ignored", path, exc)
            if header is None or header.get("fingerprint") != self.fingerprint:
                log.warning("prompt cache: %s is of another version or model; ignored", path)
                continue
            ns = header["namespace"]
            namespace = tuple(ns) if isinstance(ns, list) else ns
            tokens = tuple(header["tokens"])
            nbytes = sum(_nbytes(shape, dtype) for shape, dtype in header["tensors"])
            self.entries[path.stem] = Entry(namespace, tokens, None, nbytes, path)
        self._fit_disk()

    def _read(self, entry: Entry) -> list[torch.Tensor] | None:
        """An entry's tensors from its file, checked against its header and SHA-256 (None: not served)."""
        import torch

        if entry.path is None:
            return None
        try:
            with open(entry.path, "rb") as f:
                header = self._header(f)
                payload = f.read()
            if header is None or header["fingerprint"] != self.fingerprint or tuple(header["tokens"]) != entry.tokens:
                raise ValueError("its header does not match")
            if hashlib.sha256(payload).hexdigest() != header["sha256"]:
                raise ValueError("its contents do not match their checksum")
            tensors, at = [], 0
            for shape, dtype in header["tensors"]:
                n = _nbytes(shape, dtype)
                if n == 0:  # (an int8 cache's float16 layer's empty scales: frombuffer takes no empty buffer)
                    tensors.append(torch.empty(shape, dtype=getattr(torch, dtype)))
                    continue
                raw = torch.frombuffer(bytearray(payload[at : at + n]), dtype=torch.uint8)
                tensors.append(raw.view(getattr(torch, dtype)).view(shape))
                at += n
            if at != len(payload):
                raise ValueError("its contents are longer than its header says")
            return tensors
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            log.warning("prompt cache: %s is not served (%s)", entry.path, exc)
            return None


AUTO_BYTES = 4 << 30  # --cache-ram -1: this, or a quarter of the machine's memory if less


def cache_bytes(cache_ram_mib: int, total_memory: int | None = None) -> int:
    """The prompt cache's budget in bytes for ``--cache-ram`` (MiB; -1: auto, a quarter of the memory the server
    may use: the machine's, or its container's limit where that is lower, at most AUTO_BYTES)."""
    if cache_ram_mib >= 0:
        return cache_ram_mib << 20
    if total_memory is None:
        total_memory = memory_limit()
    return min(AUTO_BYTES, total_memory // 4)


def memory_limit() -> int:
    """The memory this process may use: the machine's, or a container's limit (cgroup v2) where lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 4 * AUTO_BYTES
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            total = min(total, int(limit))
    except (OSError, ValueError):
        pass
    return total


def fingerprint(model: str, layout: Sequence) -> str:
    """What a saved cache must have been made with to be served: the model (its file's digest) and the cache's
    layout (layers, their slots, heads, head size, dtype: anything that changes the tensors' meaning)."""
    return hashlib.sha256(json.dumps([VERSION, model, [str(x) for x in layout]]).encode()).hexdigest()


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    import torch

    n = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    for d in shape:
        n *= d
    return n
