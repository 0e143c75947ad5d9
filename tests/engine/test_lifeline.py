"""lifeline.keep_step_buffers and release_free_memory: a step's large buffer, freed and allocated again, keeps its
pages while the engine works, and goes back to the system when the engine goes idle (glibc, in a process of its
own, counting the page faults of each allocation that touches every page)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import ctypes, resource, sys
sys.path.insert(0, sys.argv[1])
from inference_api.engine.lifeline import keep_step_buffers, release_free_memory

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 40 << 20  # past glibc's largest mmap threshold (32 MB), as a 32-row step's logits over 262,144 tokens


def step_faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


step_faults()
default = step_faults()
keep_step_buffers()
step_faults()  # the heap grows once
kept = step_faults()
release_free_memory()  # idle: the kept pages go back
after_idle = step_faults()
print(default, kept, after_idle)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_steps_large_buffer_keeps_its_pages_while_working_and_returns_them_when_idle():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    default, kept, after_idle = map(int, out.split())
    pages = (40 << 20) // 4096
    assert default > pages // 2  # glibc's default: mapped, every page faulted in, unmapped at free
    assert kept < pages // 20  # kept: the next step's buffer finds its pages
    assert after_idle > pages // 2  # trimmed when idle: handed back
