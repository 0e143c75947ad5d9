"""Builds and loads the CPU kernels (csrc/: the quantized linears, attention, the decoder).

Builds go into folders of the model cache, each named by a digest of the sources, the compiler flags and the
instruction set they target, so a cache shared by machines of different CPUs never hands one a build for
another. Two kinds:

- **native** (``-march=native``): compiled on this machine at its first start (or by the set-up command), keyed
  by this CPU's relevant feature flags;
- **prebuilt** for an instruction-set level (``LEVELS``: AVX512-VNNI, AVX2), compiled ahead of time where no CPU
  is known yet into the package's ``prebuilt`` folder (or a cache), as the server image does at build time
  (``python -m inference_api.kernels --prebuild``), so its containers need no compiler and start at once
  (a volume mounted over the model cache does not hide them).

``load_kernels`` imports an existing build (native first, then the best level this CPU runs) without the
compiler; it compiles a native build only when there is none. With neither a build nor a compiler it returns
None and says why in one line: the caller then serves dequantized weights, several times slower.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
PREBUILT = Path(__file__).with_name("prebuilt")  # the image's builds (git-ignored in a checkout)
# the flags that change what -march=native compiles (a native build's key)
NATIVE_KEY = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
)
# what a server without its kernels pays, measured on SmolLM2 (an AMD EPYC with AVX-512, 2026-11-23): said when they
# are missing
# The i-quants whose blocks of 32 take at most 16 levels, served in IQ4_NL's bytes but for the scale (per 32 weights
# a float32 scale d, then 16 bytes of nibbles, weights 0..15 in the low ones, each indexing the type's levels: w = d *
# level; LEVEL_BLOCK bytes) under type numbers of their own past ggml's: name -> (number, levels).
# csrc/gguf_legacy.h holds the same numbers (a constant without torch: gguf_meta reads its names for pre-flight).
LEVEL_TYPES: dict[str, tuple[int, tuple[int, ...]]] = {
    "IQ3_XXS": (120, (-62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62)),
    "IQ2_XXS": (121, (-43, -25, -8, 8, 25, 43)),
    "IQ1_S": (122, (-9, -7, -1, 1, 7, 9)),
}
LEVEL_BLOCK = 20


WITHOUT_KERNELS = "weights are served dequantized, about 8x slower per token (40 against 5 ms on SmolLM2)"

# the CPU kernels' instruction-set levels a build can target ahead of time, best first: (-march, the
# /proc/cpuinfo flags it needs); this package builds them, the plan decides as a CPU with only these would
LEVELS = {
    "avx512vnni": (
        "cascadelake",
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"}),
    ),
    "avx2": ("haswell", frozenset({"avx2", "fma", "f16c", "bmi2"})),
}


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo cannot tell)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(flags.split())


def sources() -> list[Path]:
    """The compiled units (each .cpp; the headers they include count towards the build's digest)."""
    return sorted(CSRC.glob("*.cpp"))


def level_for(flags: frozenset[str]) -> str | None:
    """The best prebuilt level a CPU with these flags runs, or None."""
    return next((name for name, (_, needs) in LEVELS.items() if needs <= flags), None)


def _build_dir(root: Path, target: str, cflags: tuple[str, ...]) -> tuple[str, Path]:
    """(module name, folder) of a build for target under root (a cache's kernels folder, or PREBUILT)."""
    digest = hashlib.sha256(
        b"".join(p.name.encode() + p.read_bytes() for p in sorted(CSRC.glob("*.[ch]*")))
        + " ".join((target, *cflags)).encode()
    ).hexdigest()[:12]
    # resolved: torch's extension versioner hashes the folder's name, so a relative and an absolute name of one
    # cache in one process would otherwise compile a second version over the first one's objects
    return f"woq_{digest}", Path(root).resolve() / f"woq-{digest}"


def _import_built(name: str, build: Path):
    """The extension module a build left in its folder, imported without the compiler (None if there is none)."""
    so = build / f"{name}.so"
    if name in sys.modules:
        return sys.modules[name]
    if not so.is_file():
        return None
    import torch  # noqa: F401  (the extension links against torch's libraries: they must be loaded first)

    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"{so} is no extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _compile(root: Path, march: str, target: str, cflags: tuple[str, ...], load: bool = True):
    """Compile a build into its folder under root; ``load``: import it too (else only its files are written: a
    level this machine cannot run, whose import would stop the process with an illegal instruction)."""
    from torch.utils import cpp_extension

    name, build = _build_dir(root, target, cflags)
    build.mkdir(parents=True, exist_ok=True)
    # the venv's ninja, when the interpreter runs without the venv activated
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    options = dict(extra_cflags=["-O3", f"-march={march}", "-fopenmp", *cflags], extra_ldflags=["-fopenmp"])
    if load:
        return cpp_extension.load(name, [str(p) for p in sources()], build_directory=str(build), **options)
    # what cpp_extension.load does before it imports (torch's own build function, the same ninja file)
    cpp_extension._write_ninja_file_and_build_library(
        name,
        [str(p) for p in sources()],
        extra_cuda_cflags=None,
        extra_sycl_cflags=None,
        extra_include_paths=None,
        build_directory=str(build),
        verbose=False,
        with_cuda=False,
        with_sycl=False,
        **options,
    )
    return build / f"{name}.so"


def load_kernels(cache_dir: Path, cflags: tuple[str, ...] = (), level: str | None = None):
    """The compiled kernels for this machine (cflags: extra compiler flags), or None when there is no build for it
    and none can be made; ``level`` (LEVELS: the plan's ``cpu_level``): that level's build, compiled into the cache
    when neither the image nor the cache has it. The module's ``build`` says which it is: "native", "prebuilt
    <level>" (the image's) or "level <level>" (built into the cache, now or before)."""
    flags = cpu_flags()
    native = "native:" + ",".join(f for f in NATIVE_KEY if f in flags)
    cache = Path(cache_dir) / "kernels"
    try:
        built, build = (
            (None, "") if level is not None else (_import_built(*_build_dir(cache, native, cflags)), "native")
        )
        best = level or (level_for(flags) if not cflags else None)
        if built is None and best is not None:  # the image's builds, then a cache's
            built, build = _import_built(*_build_dir(PREBUILT, best, cflags)), f"prebuilt {best}"
            if built is None:
                built, build = _import_built(*_build_dir(cache, best, cflags)), f"level {best}"
        if built is None and level is not None:
            built, build = _compile(cache, LEVELS[level][0], level, cflags), f"level {level}"
        if built is None:
            built, build = _compile(cache, "native", native, cflags), "native"
        built.build = build
        return built
    except Exception as exc:  # no compiler, no headers, a read-only cache: serve without the kernels
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        log.warning("quantized CPU kernels unavailable (%s): %s", why, WITHOUT_KERNELS)
        return None


def prebuild(root: Path = PREBUILT, levels: tuple[str, ...] = tuple(LEVELS)) -> dict[str, Path]:
    """Every level's build under root (the image's build step: the package's prebuilt folder), none of them loaded,
    so any x86 build host makes them all (importing the AVX512-VNNI build on an AVX2-only CPU stops the process
    with an illegal instruction); {level: its module's file}."""
    built = {}
    for level in levels:
        so = _compile(root, LEVELS[level][0], level, (), load=False)
        if not Path(so).is_file():
            raise RuntimeError(f"the {level} build left no {so}")
        built[level] = Path(so)
    return built
