"""What every engine process (rank 0 and the tensor-parallel ranks) does for its life: die with the process that
started it, and hand freed memory back to the system."""

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


def release_free_memory() -> None:
    """Hand memory the process no longer uses back to the system: start-up's temporaries, and the buffers of
    past steps that the C allocator keeps (glibc's malloc_trim, which runs without the GIL; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
