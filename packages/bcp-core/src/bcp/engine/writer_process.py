"""The writer process of asynchronous saves: one per training process, started with the first save
that uses it and kept for the next ones. The training process stages the pieces into shared memory
(``shared_memory``), plans, agrees and commits; the writer process writes the data files and
computes their checksums (``writer_process_main``), so those run under an interpreter lock of their
own instead of taking turns with the training thread for the training process's.

It is a fresh interpreter (not a fork: a fork of a process with threads or CUDA state is unsafe),
started from a few lines that import only bcp's storage layer and checksums, not torch. It is
stopped by ``close`` (``bcp.shutdown()``, the destruction of the last process group, interpreter
exit); if the training process dies instead, its socket closes and the writer process ends too,
quietly.

It ignores SIGINT. A terminal's Ctrl-C reaches its whole foreground process group, the writer
process included; the training process alone decides what a Ctrl-C means for a pending save (at
exit, the first lets it commit, a second abandons it), and tells the writer process. It stays in the
training process's process group and session, so that a launcher's or a terminal's other signals
(SIGTERM, SIGHUP, Ctrl-Z) reach it as they reach the job.
A writer process that dies fails the save it was writing (nothing is committed) and the next save
starts a new one.

Only storages that can be rebuilt in another process serve: those of ``bcp.storage`` that pickle
(local paths and network file systems, fsspec URLs). ``memory://`` lives in the training process's
memory, and S3 holds live clients: their saves write from threads in the training process.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Any, Sequence

from bcp.engine.process_wire import PeerGone, receive, send
from bcp.engine.shared_memory import SharedHostBuffer
from bcp.engine.writer_jobs import Abandon, Done, Failed, Failure, FileJob, SharedBuffer, Stop, WriteJob, read_reply
from bcp.errors import CheckpointError, SaveAbandonedError, StorageError
from bcp.storage.memory import MemoryStorage

#: What the new interpreter runs: bcp's package without its ``__init__`` (which imports torch), then
#: the writer's loop. The script's directory (the current one, for ``-c``) is taken off the path.
#: SIGINT is blocked while the process starts (see ``WriterProcess``) and ignored before it is let
#: through, so that a Ctrl-C during the start is dropped too.
_BOOTSTRAP = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
              "import sys, types; del sys.path[0]; package = types.ModuleType('bcp'); "
              "package.__path__ = [sys.argv[2]]; sys.modules['bcp'] = package; "
              "from bcp.engine.writer_process_main import serve; serve(int(sys.argv[1]), int(sys.argv[3]))")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: At most this many data files per rank when the writer process writes them (one thread each):
#: with direct I/O, one, two and four commit within the noise of each other; one file kept the step
#: rate about 2% better, but a load streams a rank's files with a thread each, so two stay
#: (``benchmarks/async_lane.py``).
FILES_AT_ONCE = 2
#: Whether the writer process writes the page-aligned bulk of local files by direct I/O, bypassing
#: the page cache, where the file system allows it (``LocalStorage.write_file_direct``): the disk
#: reads the shared staging memory, and the kernel does not spend the writer's CPU time copying it
#: into the page cache (``benchmarks/async_lane.py``).
DIRECT_IO = True
#: How long ``close`` waits for the writer process to leave before killing it.
STOP_WAIT_S = 10.0
#: How often a waiting save looks for an abandon request: each look takes the interpreter lock from
#: the training thread for a moment.
POLL_S = 0.2


def storage_for_process(storage: Any) -> bytes | None:
    """``storage`` pickled for the writer process, or None where it cannot be rebuilt there."""
    if isinstance(storage, MemoryStorage) or not type(storage).__module__.startswith("bcp.storage."):
        return None
    try:
        return pickle.dumps(storage, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # live connections, locks: this storage stays in the training process
        return None


class WriterProcess:
    """A running writer process; ``write_files`` runs one job at a time (the lane's write stage)."""

    def __init__(self, niceness: int) -> None:
        #: How much nicer than the training process it runs (and at the lowest I/O priority if > 0).
        self.niceness = niceness
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The new process inherits this thread's signal mask: SIGINT stays pending until it ignores it.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(theirs.fileno()), _PACKAGE_DIR, str(niceness)],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            theirs.close()
        self._sock = ours
        self._mapped: set[int] = set()  # buffers the writer process has mapped
        self._lock = threading.Lock()  # one job (its request and its reply) at a time
        self._sending = threading.Lock()  # one message at a time: an abandon request may come from any thread

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return self._process.poll() is None

    def write_files(self, storage: bytes, chunk: int, files: Sequence[FileJob],
                    buffers: Sequence[SharedHostBuffer], live: set[int],
                    abandon: threading.Event | None, what: str, display: str, level: int = 1) -> Done:
        """Write ``files`` to ``storage`` (``WriteJob``; compressed pieces at zstd ``level``); the
        reply: each checksummed item's chunk checksums and stored chunks, per file. ``buffers`` hold
        the pieces; ``live`` are the ids of every shared buffer still held (the writer process unmaps
        the others). ``what`` names the job in errors."""
        new = [b for b in buffers if b.id not in self._mapped]
        job = WriteJob(storage, chunk, DIRECT_IO, list(files), sorted(live), [SharedBuffer(b.id, b.nbytes) for b in new],
                       level)
        with self._lock:
            try:
                self._send(job, [b.fd for b in new])
                self._mapped = (self._mapped | {b.id for b in new}) & live
                reply = self._await_reply(abandon)
            except (PeerGone, OSError) as exc:
                raise self._died(what, display) from exc
        if isinstance(reply, Done):
            return reply
        if reply.reason is Failure.ABANDONED:
            raise SaveAbandonedError(f"{what} was abandoned before its files were complete", path=display)
        if reply.reason is Failure.STORAGE:
            raise StorageError(f"{what} failed in bcp's writer process: {reply.message}", path=display)
        raise CheckpointError(f"{what} failed in bcp's writer process:\n{reply.message}", path=display)

    def close(self) -> None:
        """Stop the writer process (killed if it does not leave within ``STOP_WAIT_S``)."""
        with self._lock:
            try:
                self._send(Stop())
            except (PeerGone, OSError):
                pass  # already gone
            with self._sending:
                self._sock.close()
        try:
            self._process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def abandon(self) -> None:
        """Asks the writer process to stop its job before its next piece, now (from any thread;
        ``write_files`` then raises ``SaveAbandonedError``). Without a job it has nothing to stop."""
        try:
            self._send(Abandon())
        except (PeerGone, OSError):
            pass  # gone or closed: no job left to stop

    def _send(self, message: WriteJob | Abandon | Stop, fds: Sequence[int] = ()) -> None:
        with self._sending:
            send(self._sock, message, list(fds))

    def _await_reply(self, abandon: threading.Event | None) -> Done | Failed:
        # Asked at once where the save was abandoned already: the request ``abandon()`` sent may have
        # reached the writer process before the job, which then had nothing to stop.
        asked = False
        while True:
            if abandon is not None and not asked and abandon.is_set():
                self._send(Abandon())
                asked = True
            if select.select([self._sock], [], [], POLL_S)[0]:
                return receive(self._sock, read_reply)[0]

    def _died(self, what: str, display: str) -> StorageError:
        try:
            code = self._process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            code = self._process.wait()
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return StorageError(f"{what} failed: bcp's writer process (pid {self._process.pid}) {how} before its "
                            "files were complete; the generation is not committed", path=display)
