"""The background lane of asynchronous saves: one worker thread per process runs the write and
commit of each save in call order, so commits happen in the order ``save`` was called. At exit the
interpreter waits for every pending save before thread pools shut down, so none is dropped."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_pending: list[Future] = []


def submit(job: Callable[[], Any]) -> Future:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcp-async-save")
            _wait_at_exit()
        future = _executor.submit(job)
        _pending[:] = [f for f in _pending if not f.done()] + [future]
        return future


def wait_pending() -> None:
    """Block until every asynchronous save of this process is committed (or failed). Errors are
    not raised here: each save's handle raises its own from ``wait()``."""
    with _lock:
        pending = list(_pending)
    for future in pending:
        future.exception()


def _wait_at_exit() -> None:
    # concurrent.futures refuses new work once its own exit hook has run, and a save's writers
    # use thread pools: our hook must run before that one. threading's exit hooks run before
    # atexit's, newest first; fall back to atexit where that private hook is missing.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(wait_pending)
    else:
        import atexit

        atexit.register(wait_pending)


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker, Megatron's checkpoint process) inherits the parent's
    # pending saves but not the thread that runs them: waiting for them at its exit would hang.
    global _executor, _lock
    _lock = threading.Lock()
    _executor = None
    _pending.clear()


os.register_at_fork(after_in_child=_forget_in_child)
