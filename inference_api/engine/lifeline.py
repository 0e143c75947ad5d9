"""What every engine process (rank 0 and the tensor-parallel ranks) does for its life: die with the process that
started it, and hand freed memory back to the system; and the kernel's scheduling class of the server's
processes."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """End this process as soon as the process that started it ends, however it ends, busy or idle.

    Two independent guards: Linux's parent-death signal (SIGKILL from the kernel when the parent goes), and a
    thread that waits on multiprocessing's parent sentinel, a pipe that reaches EOF when the parent is gone. A
    process started otherwise (the tensor-parallel ranks: subprocess) names its parent's ``parent_pid``, checked
    once the signal is in place; its parent's socket reaching EOF is its second guard.
    Signals sent to the whole process group (Ctrl-C, ``kill -TERM -pgid``) are ignored: the worker drains first
    and then stops the engine itself (which stops its ranks).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            log.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent pipe")
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before the signal was in place
        os._exit(0)
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return
    if not parent.is_alive():  # the parent died before the guards were in place
        os._exit(0)

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def scheduling_class(web_worker: bool) -> None:
    """Put this process's threads (and the threads and processes they start from now on) in the kernel's
    SCHED_BATCH class for the web worker, or back in the default one (SCHED_OTHER) for an engine process the
    worker starts.

    A request passes between the web worker's threads (the connection loop, the request's thread, the feeder to
    the engine, the reader of the engine's answers), each waking the next; in the default class a woken thread may
    preempt the one that woke it, which then waits off the CPU holding the GIL that the woken thread needs. A woken
    thread of the batch class never preempts the running one (the scheduler's tick does). On 2 cores,
    all-MiniLM-L6-v2 Q8_0, 32 kept-alive embedding clients, alternating 8 s loads: 604 to 703 texts/s against 536
    to 614 with the worker in the default class (2026-11-29); 32 generating streams of the embedded model the same
    as before (1.01x, one stream 1.05x). Where the kernel refuses, nothing changes."""
    policy = getattr(os, "SCHED_BATCH" if web_worker else "SCHED_OTHER", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]  # (the threads the process has already started)
    except OSError:
        threads = [0]
    for thread in threads:
        try:
            os.sched_setscheduler(thread, policy, os.sched_param(0))
        except OSError as exc:
            log.debug("scheduling class unchanged: %s", exc)


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
# free memory at the heap's top the allocator keeps while the engine works (KEEP_FREED: a step's largest buffers)
KEEP_FREED = 64 << 20


def keep_step_buffers() -> None:
    """While the engine works, the buffers a step frees stay with the C allocator for the next step. glibc maps an
    allocation past its mmap threshold (32 MB at most) on its own and unmaps it at free, so the next step's buffer
    of the same size faults every page in again: a 32-row decode step's logits over Gemma 3's 262,144 tokens are
    33.5 MB, 8,192 pages cleared and faulted each step (the step 58 against 50 ms in-process, 2026-11-30). Every
    allocation comes from the heap, which keeps up to KEEP_FREED free at its top (a tensor-parallel rank's bound);
    when the engine goes idle it hands that back too (release_free_memory). Elsewhere than glibc a no-op."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None)
            libc.mallopt(_M_MMAP_MAX, 0)
            libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREED)
        except (OSError, AttributeError):  # not glibc
            pass


def release_free_memory() -> None:
    """Hand memory the process no longer uses back to the system: start-up's temporaries, and the buffers of
    past steps that the C allocator keeps (glibc's malloc_trim, which runs without the GIL; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def settle_after_load() -> None:
    """A process that runs steps (the engine, each tensor-parallel rank), after its load: the memory loading freed
    goes back to the system (parsing a GGUF's metadata, Gemma 3's 262,144-token vocabulary among it, about 0.6 GB
    of Python objects, and its tokenizer leave freed pages that glibc keeps; trimmed, the engine of Gemma 3 270M
    holds 0.69 GB instead of 0.81 after its start, docs/performance.md), then the steps' buffers stay for the next
    step (keep_step_buffers)."""
    import gc

    gc.collect()
    release_free_memory()
    keep_step_buffers()
