"""The writer process's side (``writer_process`` starts it): it maps the training process's staging
buffers (shared memory), and for each job writes the data files it is given and computes their
chunk checksums, one thread per file, under its own interpreter lock, so none of that waits for or
delays the training thread. It answers each job with the checksums, or with why it failed.

It imports no torch and nothing beyond the storage layer and the checksums, to start in a fraction
of a second. It ends when told to, when its socket closes, or when the training process is gone:
then quietly (the training process's own end says what happened to its save), or with one line
where something else stopped it.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import socket
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Iterator, Sequence

from bcp.chunk_codecs import RAW
from bcp.engine.checksum import chunk_crcs
from bcp.engine.chunk_coding import ItemCoder
from bcp.engine.priority import lower_this_thread
from bcp.engine.process_wire import PeerGone, receive, send
from bcp.engine.writer_jobs import (Abandon, Done, Failed, Failure, FileItem, ItemChunks, Padding, SharedBuffer,
                                    StagedPiece, Stop, WriteJob, read_request)

#: How often the writer looks for an abandon request (or a vanished trainer) while files are written.
POLL_S = 0.05


class _Abandoned(Exception):
    pass


class _Writer:
    def __init__(self, sock: socket.socket, parent: int) -> None:
        self.sock = sock
        self.parent = parent
        self.maps: dict[int, mmap.mmap] = {}
        self.storages: dict[bytes, Any] = {}
        self.pool: ThreadPoolExecutor | None = None
        self.stop = threading.Event()

    def serve(self) -> None:
        """Answers jobs until told to stop; :class:`PeerGone` once the training process is gone."""
        while True:
            message, fds = receive(self.sock, read_request)
            if isinstance(message, Stop):
                return
            if isinstance(message, WriteJob):
                send(self.sock, self.job(message, fds))
            # an Abandon arriving after its job finished has nothing left to stop

    def job(self, job: WriteJob, fds: list[int]) -> Done | Failed:
        self.stop.clear()
        try:
            self.map_buffers(job.new, fds, job.live)
            self.watch()  # an abandon request sent after the job, before the writer got to it: no write starts
            if self.stop.is_set():
                raise _Abandoned()
            storage = self.storage(job.storage)
            files = job.files
            if self.pool is None or self.pool._max_workers < len(files):
                if self.pool is not None:
                    self.pool.shutdown()
                self.pool = ThreadPoolExecutor(max_workers=max(1, len(files)), thread_name_prefix="bcp-write")
            futures = [self.pool.submit(self.write_file, storage, file.name, file.items, job.chunk, job.direct,
                                        job.level) for file in files]
            while True:
                self.watch()  # first at once: an abandon request may have come with the job
                if not wait(futures, timeout=POLL_S).not_done:
                    break
                if any(f.done() and f.exception() is not None for f in futures):
                    self.stop.set()  # one file failed: the save fails, the others need not finish
            errors = [f.exception() for f in futures if f.exception() is not None]
            first = next((e for e in errors if not isinstance(e, _Abandoned)), errors[0] if errors else None)
            if first is not None:
                raise first
            written = [future.result() for future in futures]
            return Done([crcs for crcs, _ in written], [stored for _, stored in written])
        except _Abandoned:
            return Failed(Failure.ABANDONED, "the save was abandoned before its files were complete")
        except OSError as exc:
            return Failed(Failure.STORAGE, str(exc))
        except BaseException:
            return Failed(Failure.ERROR, traceback.format_exc())

    def watch(self) -> None:
        """Between polls: an abandon request, or the training process gone, stops the writes."""
        if os.getppid() != self.parent:
            self.stop.set()
        if select.select([self.sock], [], [], 0)[0]:
            try:
                message, _ = receive(self.sock, read_request)
            except PeerGone:
                self.stop.set()
                return
            if isinstance(message, (Abandon, Stop)):
                self.stop.set()

    def map_buffers(self, new: list[SharedBuffer], fds: list[int], live: list[int]) -> None:
        for buffer, fd in zip(new, fds):
            try:
                self.maps[buffer.id] = mmap.mmap(fd, max(1, buffer.nbytes))
            finally:
                os.close(fd)
        for buffer_id in set(self.maps) - set(live):  # the training process gave these back
            self.maps.pop(buffer_id).close()

    def storage(self, pickled: bytes) -> Any:
        storage = self.storages.get(pickled)
        if storage is None:
            storage = self.storages[pickled] = pickle.loads(pickled)
        return storage

    def write_file(self, storage: Any, name: str, items: Sequence[FileItem], chunk: int, direct: bool,
                   level: int) -> tuple[list[list[int]], list[ItemChunks | None]]:
        """Write one file: ``items`` in order; each piece's and value's chunk checksums, in order
        (those the training process sent along, else computed while writing), and how each one's
        chunks were stored (None: as they are; a piece with a codec is compressed at ``level``).
        With ``direct``, through the storage's direct I/O where it has one."""
        crcs: list[list[int]] = []
        stored: list[ItemChunks | None] = []

        def stream() -> Iterator[memoryview]:
            for item in items:
                if self.stop.is_set():
                    raise _Abandoned()
                if isinstance(item, Padding):
                    yield memoryview(bytes(item.nbytes))
                    continue
                data = memoryview(self.maps[item.buffer])[item.offset: item.offset + item.nbytes] \
                    if isinstance(item, StagedPiece) else memoryview(item.data)
                crcs.append(item.crcs if item.crcs is not None else chunk_crcs(data, chunk))
                if isinstance(item, StagedPiece) and item.codec != RAW:
                    coder = ItemCoder(item.codec, item.width, level, chunk, None)
                    yield from coder.code(data, crcs[-1])
                    stored.append(ItemChunks(coder.codecs, coder.nbytes, coder.crcs))
                else:
                    yield data
                    stored.append(None)
                del data  # a view would keep the map from closing

        write = getattr(storage, "write_file_direct", None) if direct else None
        (write or storage.write_file)(name, stream())
        return crcs, stored


def serve(fd: int, niceness: int) -> None:
    """Run the writer on the socket ``fd`` until told to stop or the training process is gone;
    ``niceness`` above the training process's, with the lowest best-effort I/O priority (if > 0)."""
    if niceness > 0:
        lower_this_thread(niceness)  # threads started later inherit the main thread's priority
    with socket.socket(fileno=fd) as sock:
        writer = _Writer(sock, os.getppid())
        try:
            writer.serve()
        except PeerGone:  # the training process died (or closed us without a word): nothing to say
            writer.stop.set()
        except BaseException as exc:  # the one line of a writer process that did not end as told
            print(f"bcp's writer process (pid {os.getpid()}) stopped: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
            writer.stop.set()
            raise SystemExit(1) from None
        finally:
            if writer.pool is not None:
                writer.pool.shutdown()
