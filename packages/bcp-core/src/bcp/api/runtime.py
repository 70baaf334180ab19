"""What one process keeps between saves, in one object with a clear lifetime: the plan cache, the
host buffers of asynchronous saves, the background lane that commits them in order and the staging
buffers of loads.
``reset_runtime()`` (tests, or a job re-creating its process
groups) waits for pending saves and starts afresh."""

from __future__ import annotations

import os
import threading

from bcp.engine.background import BackgroundLane
from bcp.engine.load_staging import LoadStagingPool
from bcp.engine.staging import HostBufferPool
from bcp.planning.plan_cache import PlanCache


class Runtime:
    """A process's checkpointing state."""

    def __init__(self) -> None:
        self.plan_cache = PlanCache()
        #: Two sets: the next save stages into one while the previous one still writes from the other.
        self.buffers = HostBufferPool(max_sets=2)
        self.background = BackgroundLane()
        #: The last load's staging buffers, which the next load reuses.
        self.load_staging = LoadStagingPool()

    def close(self) -> None:
        """Wait for every pending save, then release the lane's thread, the cached plans and the
        load staging buffers."""
        self.background.close()
        self.plan_cache.clear()
        self.load_staging.clear()


_current = Runtime()


def runtime() -> Runtime:
    """This process's runtime."""
    return _current


def reset_runtime() -> None:
    """Wait for this process's pending saves, then replace its runtime with a fresh one."""
    global _current
    previous, _current = _current, Runtime()
    previous.close()


def _wait_at_exit() -> None:
    _current.background.wait_pending()


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker, Megatron's checkpoint process) inherits the parent's
    # pending saves but not the thread that runs them: waiting for them at its exit would hang.
    global _current
    _current = Runtime()


# concurrent.futures refuses new work once its own exit hook has run, and a save's writers use
# thread pools: our hook must run before that one. threading's exit hooks run before atexit's,
# newest first; fall back to atexit where that private hook is missing.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_wait_at_exit)
else:
    import atexit

    atexit.register(_wait_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)
