"""Background priority for the writer threads of asynchronous saves: on Linux, CPU niceness and
I/O priority are per thread, so the writers yield cores and the disk to the training thread and
take what it leaves (they are never starved: best-effort, not idle, classes)."""

from __future__ import annotations

import ctypes
import os
import platform
import threading

#: Added to the writer threads' niceness: at +10 the kernel gives a busy training thread about ten
#: times the CPU share of each writer when both want the same core.
NICENESS = 10

#: Added to the niceness of the writer process of asynchronous saves (``writer_process``), all its
#: threads; 0 leaves it at the training process's priority. Writing by direct I/O it needs little
#: CPU time, which at +10 it gets sooner than at +19 without costing training more
#: (``benchmarks/async_lane.py``).
WRITER_PROCESS_NICENESS = 10

_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(platform.machine())
_IOPRIO_WHO_PROCESS = 1  # a thread id names the thread
_IOPRIO_CLASS_BE, _LOWEST_LEVEL = 2, 7


def lower_this_thread(niceness: int = NICENESS) -> None:
    """Lower the calling thread's CPU priority by ``niceness`` and its I/O priority to the lowest of
    the best-effort class; a no-op where the platform has neither."""
    if not hasattr(os, "setpriority"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + niceness))
    except OSError:
        pass  # a sandbox may forbid it: the save still runs, at normal priority
    if _IOPRIO_SET is not None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall(_IOPRIO_SET, _IOPRIO_WHO_PROCESS, thread, (_IOPRIO_CLASS_BE << 13) | _LOWEST_LEVEL)
        except (OSError, AttributeError):
            pass
