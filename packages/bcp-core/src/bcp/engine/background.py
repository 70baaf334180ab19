"""The background lane of asynchronous saves: one worker thread runs the write and commit of each
save in call order, so commits happen in the order ``save`` was called."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class BackgroundLane:
    """Jobs run one at a time, in submission order, on a thread started with the first job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def submit(self, job: Callable[[], Any]) -> Future:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcp-async-save")
            future = self._executor.submit(job)
            self._pending[:] = [f for f in self._pending if not f.done()] + [future]
            return future

    def wait_pending(self) -> None:
        """Block until every job submitted so far has finished. Errors are not raised here: each
        save's handle raises its own from ``wait()``."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.exception()

    def close(self) -> None:
        """Wait for the pending jobs, then stop the thread."""
        self.wait_pending()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
