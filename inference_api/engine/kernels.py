"""Builds the CPU kernels (csrc/: the quantized linears, attention, the decoder) with the machine's C++ compiler,
once.

The build goes into a folder of the model cache, so later starts load it in well under a second; the
set-up command builds it ahead of the first start. Returns None when no compiler is available: the
caller then serves dequantized weights instead.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")


def sources() -> list[Path]:
    """The compiled units (each .cpp; the headers they include count towards the build's digest)."""
    return sorted(CSRC.glob("*.cpp"))


def load_kernels(cache_dir: Path, cflags: tuple[str, ...] = ()):
    """The compiled kernels for this machine (cflags: extra compiler flags, such as -mno-avx512f to check the AVX2
    kernels on an AVX-512 machine), or None when they cannot be built."""
    try:
        from torch.utils import cpp_extension

        digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sorted(CSRC.glob("*.[ch]*")))
                                + " ".join(cflags).encode()).hexdigest()[:12]
        # resolved: torch's extension versioner hashes the folder's name, so a relative and an absolute name
        # of one cache in one process would otherwise compile a second version over the first one's objects
        # (a minute each, and again for the next process that loads the first)
        build = Path(cache_dir).resolve() / "kernels" / f"woq-{digest}"
        build.mkdir(parents=True, exist_ok=True)
        # the venv's ninja, when the interpreter runs without the venv activated
        bin_dir = str(Path(sys.executable).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        return cpp_extension.load(f"woq_{digest}", [str(p) for p in sources()], build_directory=str(build),
                                  extra_cflags=["-O3", "-march=native", "-fopenmp", *cflags], extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler, no headers, a read-only cache: serve without the kernels
        log.warning("quantized CPU kernels unavailable (%s); weights are served dequantized", exc)
        return None


if __name__ == "__main__":  # the set-up step: python -m inference_api.engine.kernels [CACHE_DIR]
    logging.basicConfig(level="INFO")
    ok = load_kernels(Path(sys.argv[1] if len(sys.argv) > 1 else "model_cache")) is not None
    print("quantized CPU kernels", "ready" if ok else "unavailable")
