"""How the kernels are found: a build that exists is imported without the compiler (the server image has none);
with no build and no compiler the server says so in one line, with what it costs, and serves without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from servers import MODEL_CACHE, ROOT

from inference_api.kernels import LEVELS, level_for

LOAD = (
    "import logging, sys; from pathlib import Path; logging.basicConfig();"
    "from inference_api.kernels import load_kernels;"
    "k = load_kernels(Path(sys.argv[1])); print('loaded' if k is not None else 'none')"
)


def load_without_compiler(cache: str) -> subprocess.CompletedProcess:
    env = {"HOME": os.environ.get("HOME", "/tmp"), "PATH": str(ROOT / ".venv" / "bin"), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", LOAD, cache], env=env, capture_output=True, text=True, timeout=300)


def test_a_build_that_exists_needs_no_compiler():
    out = load_without_compiler(MODEL_CACHE)  # the set-up step built this machine's kernels there
    assert out.stdout.split() == ["loaded"], out.stderr[-2000:]


def test_without_a_build_or_a_compiler_one_line_says_what_it_costs(tmp_path):
    out = load_without_compiler(str(tmp_path))
    assert out.stdout.split() == ["none"]
    lines = [line for line in out.stderr.splitlines() if "kernels unavailable" in line]
    assert len(lines) == 1 and "dequantized" in lines[0] and "slower" in lines[0]


def test_levels_need_what_their_march_gives():
    assert level_for(frozenset()) is None
    assert level_for(LEVELS["avx2"][1]) == "avx2"
    assert level_for(LEVELS["avx512vnni"][1] | LEVELS["avx2"][1]) == "avx512vnni"
    assert level_for(LEVELS["avx512vnni"][1] - {"avx512_vnni"} | LEVELS["avx2"][1]) == "avx2"


PREBUILD = (
    "import sys; from pathlib import Path;"
    "from inference_api.kernels import prebuild;"
    "built = prebuild(Path(sys.argv[1]), (sys.argv[2],));"
    "assert str(built[sys.argv[2]]) not in Path('/proc/self/maps').read_text(), 'the level was loaded';"
    "print(*(f'{level}={so}' for level, so in built.items()))"
)


def test_the_prebuild_writes_a_level_without_loading_it():
    """The image's build step compiles each level without importing it (the same code for every level), so an
    AVX2-only build host, where importing the AVX512-VNNI build stops the process with an illegal instruction,
    builds the image too; a level is loaded only where the CPU runs it (load_kernels). The AVX2 level is built
    into the tests' model cache, where the kernel tests' AVX2 fixture finds it (one compile for both)."""
    out = subprocess.run(
        [sys.executable, "-c", PREBUILD, str(Path(MODEL_CACHE) / "kernels"), "avx2"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    level, so = out.stdout.split()[0].split("=", 1)
    assert level == "avx2" and so.endswith(".so") and os.path.getsize(so) > 100_000
