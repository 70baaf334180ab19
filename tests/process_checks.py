"""Processes of the tests: where to start them, and checks on those a test did not start itself
(bcp's writer process)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def own_process_group() -> dict[str, Any]:
    """``subprocess.Popen`` arguments that start the child leading a process group of its own (to
    signal or kill it with everything it started, as a terminal signals its foreground job), in
    the session of the tests. Not a session of its own: where the kernel groups scheduling by
    session (autogroup), a new session weighs as much as every other session together, and beside
    two busy loops its processes got 3% of a core where the tests' session got half of one."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` has ended (or ends within ``within_s`` seconds)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def kernel_state(pid: int) -> str:
    """What the kernel says process ``pid`` is doing (its state and the kernel function it waits
    in), for an error about a process that does not end."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/wchan") as wchan:
            waiting_in = wchan.read().strip()
    except OSError:
        return "its state cannot be read (it is gone, or this system has no /proc)"
    return f"state {state}" + (f", waiting in the kernel's {waiting_in}" if waiting_in not in ("", "0") else "")
