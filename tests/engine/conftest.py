"""The compiled kernels every kernel test runs on: this CPU's own build and, on a CPU with AVX-512, the AVX2
level's too (the kernels most users' CPUs run), so both levels are tested on any x86 machine; and the sampler's
draw on torch's operations and on each of those builds."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from servers import MODEL_CACHE

from inference_api.engine.plan import LEVELS, cpu_flags
from inference_api.engine.sampling import sample
from inference_api.kernels import load_kernels

LEVELS_HERE = ["native"] + (["avx2"] if "avx512f" in cpu_flags() and LEVELS["avx2"][1] <= cpu_flags() else [])


@functools.cache
def built(level: str):
    k = load_kernels(Path(MODEL_CACHE), level=None if level == "native" else level)
    assert k is not None, "the kernels must build on the test machines (gcc and the Python headers are there)"
    assert k.build == "native" if level == "native" else level in k.build
    return k


@pytest.fixture(scope="session", params=LEVELS_HERE)
def kernels(request):
    return built(request.param)


@pytest.fixture(scope="session", params=["torch", *LEVELS_HERE])
def draw(request):
    """sampling.sample: torch's draw, or a build's kernels'."""
    return sample if request.param == "torch" else functools.partial(sample, kernels=built(request.param))
