"""The background lane of asynchronous saves, in two stages with a thread each: a save's writes,
then its commit barrier (every rank's report to the coordinating rank, the commit, the verdict).
Each stage runs one save at a time in call order, so commits happen in the order ``save`` was
called, while the next save's writes overlap the previous save's barrier instead of waiting for it.

The lane also holds the writer process (``writer_process``) that writes the files of the saves
handed to it, started with the first such save and restarted after one that it did not survive.

The lane belongs to the process's Runtime: it is closed by ``bcp.shutdown()``, when the process
groups are destroyed, and at interpreter exit (after waiting for its saves, or abandoning them)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from bcp.engine import priority
from bcp.engine.snapshot_copy import PendingSnapshots
from bcp.engine.writer_process import WriterProcess


class BackgroundLane:
    """Two-stage jobs; each stage's thread is started with the first job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stages: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._pending: list[tuple[Future, str]] = []
        #: Set to abandon every save not yet committed: their writers stop (see GenerationWriter).
        self.abandon = threading.Event()
        self._process: WriterProcess | None = None
        #: The overlapped snapshot copies of the saves (``snapshot_copy``): their writes wait for them.
        self.snapshots = PendingSnapshots()

    def writer_process(self) -> WriterProcess:
        """The running writer process, started now if there is none, if the last one died, or if
        its niceness is not ``priority.WRITER_PROCESS_NICENESS`` any more."""
        niceness = priority.WRITER_PROCESS_NICENESS
        with self._lock:
            if self._process is not None and (not self._process.alive() or self._process.niceness != niceness):
                self._process.close()
                self._process = None
            if self._process is None:
                self._process = WriterProcess(niceness)
            return self._process

    def stop_writing(self) -> None:
        """Abandons every save not yet committed: their writers stop before their next piece, the
        writer process's as soon as it reads the request, sent now (see ``GenerationWriter``)."""
        self.abandon.set()
        with self._lock:
            process = self._process
        if process is not None:
            process.abandon()

    def writer_pid(self) -> int | None:
        """The writer process's id while one runs (it may have died since), else None."""
        with self._lock:
            return self._process.pid if self._process is not None else None

    def submit(self, first: Callable[[], Any], then: Callable[[Any], Any], label: str = "a save") -> Future:
        """Runs ``first()`` on the first stage's thread, then ``then(its result)`` on the second's;
        the future holds ``then``'s result, or the exception of whichever stage raised. ``label``
        names the job in what the process says while it waits for it at exit."""
        done: Future = Future()
        # The stages take the callables out of this list: once the handle's wait() returns, the lane
        # holds nothing of the save (its coordinator and, through it, a process group the caller
        # may have destroyed stay referenced by no thread of bcp, so they are released at once).
        job: list[Any] = [first, then]

        def run_first() -> None:
            first, then = job
            job.clear()
            try:
                result = first()
            except BaseException as exc:  # the save's handle raises it from wait()
                del first, then
                done.set_exception(exc)
                return
            handoff = [then, result]
            del first, then, result
            try:
                second.submit(_settle, done, handoff)
            except BaseException as exc:  # the lane was closed meanwhile: never leave the handle waiting
                done.set_exception(exc)

        with self._lock:
            if self._stages is None:
                self._stages = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcp-async-write"),
                                ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcp-async-commit"))
            head, second = self._stages
            head.submit(run_first)
            self._pending[:] = [(f, what) for f, what in self._pending if not f.done()] + [(done, label)]
        return done

    def pending(self) -> list[str]:
        """The labels of the jobs not finished yet, in call order."""
        return [what for _, what in self.pending_jobs()]

    def pending_jobs(self) -> list[tuple[Future, str]]:
        """The jobs not finished yet, in call order: each one's future (which says later whether
        it finished, and how) and label."""
        with self._lock:
            return [(f, what) for f, what in self._pending if not f.done()]

    def wait_pending(self, timeout: float | None = None) -> bool:
        """Block until every job submitted so far has finished (or ``timeout`` seconds passed);
        returns whether they all finished. Errors are not raised here: each save's handle raises
        its own from ``wait()``."""
        with self._lock:
            pending = [f for f, _ in self._pending]
        deadline = None if timeout is None else time.monotonic() + timeout
        for future in pending:
            try:
                future.exception(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                return False
        return True

    def close(self) -> None:
        """Wait for the pending jobs, then stop the threads and the writer process."""
        self.wait_pending()
        with self._lock:
            stages, self._stages = self._stages, None
            process, self._process = self._process, None
        for stage in stages or ():
            stage.shutdown(wait=True)
        if process is not None:
            process.close()


def _settle(done: Future, job: list[Any]) -> None:
    """Runs ``then(result)`` (``job`` holds both; emptied here) and resolves ``done`` with its outcome,
    after dropping both, so that a caller woken by ``done`` finds nothing of the job referenced."""
    then, result = job
    job.clear()
    try:
        value = then(result)
    except BaseException as exc:  # the save's handle raises it from wait()
        del then, result
        done.set_exception(exc)
        return
    del then, result
    done.set_result(value)
