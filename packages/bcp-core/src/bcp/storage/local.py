"""Local or network (NFS) file system storage."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
import threading
from collections.abc import Iterable, Sequence

from bcp.storage.base import Storage

# preadv/writev take at most this many buffers per call (the POSIX minimum is 16; Linux allows 1024)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16
# Small buffers are gathered into one writev call up to this many bytes (large ones go alone).
_WRITE_BATCH_BYTES = 1 << 20


# Read-only mappings (POSIX); elsewhere every read copies into the caller's memory.
_CAN_MAP = hasattr(mmap, "PROT_READ")

# Reads open only regular files, without following a symbolic link at the last component: a FIFO
# would block open() and read() forever, a device (/dev/zero) never ends, and a link could lead
# outside the checkpoint. O_NONBLOCK makes opening a FIFO return at once so that it can be refused.
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class LocalStorage(Storage):
    """Files under a directory. Writes are fsync'd (file and directory) before they return, reads
    use ``preadv`` straight into the caller's memory (many buffers per call), so one file can be read
    by many threads; a reader that only looks at the bytes and copies parts of them (a resharded
    load) gets views of a read-only mapping of the file instead (``read_views``). Only regular files
    are read (``OSError`` otherwise); a failed write removes its partial file, so that a full disk is
    not left fuller."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.path.abspath(os.fspath(root))

    def _path(self, name: str) -> str:
        return os.path.join(self.root, *name.split("/")) if name else self.root

    def write_file(self, name: str, chunks: Iterable[memoryview]) -> None:
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_chunks(fd, chunks)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
        _fsync_dir(os.path.dirname(path))

    def put_if_absent(self, name: str, data: bytes) -> bool:
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"  # unique per writing thread
        self.write_file(os.path.relpath(temporary, self.root).replace(os.sep, "/"), [memoryview(data)])
        try:
            os.link(temporary, path)  # link() fails if the target exists: atomic create-if-absent
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(temporary)
            _fsync_dir(os.path.dirname(path))

    def read_into(self, name: str, offset: int, dest: memoryview) -> None:
        self.read_into_many(name, offset, [dest])

    def read_into_many(self, name: str, offset: int, dests: Sequence[memoryview]) -> None:
        views = [_flat_bytes(d) for d in dests if d.nbytes]
        fd = _open_regular(self._path(name))
        try:
            while views:
                got = os.preadv(fd, views[:_IOV_MAX], offset)
                if got == 0:
                    raise EOFError(f"{name}: file ends before byte {offset + sum(v.nbytes for v in views)}")
                offset += got
                views = _advance(views, got)
        finally:
            os.close(fd)

    def read_views(self, name: str, offset: int, sizes: Sequence[int]) -> list[memoryview] | None:
        """Views of a read-only mapping of the file's bytes from ``offset`` (see
        :class:`~bcp.storage.range_reads.ViewReads`). A reader that verifies bytes and copies only
        some of them out (a resharded load reads whole checksum chunks of rows it half wants) then
        saves the kernel's copy of every byte into its memory: measured here, half the CPU time of
        ``preadv`` into scratch memory, cold or warm. The mapping lives as long as any view.

        A data file shorter than the range is an ``EOFError`` before anything is mapped. Committed
        checkpoint files are never rewritten in place (retention unlinks them, which leaves a mapping
        valid), so the mapped bytes cannot shrink away under the reader; only a file truncated in
        place by another program while it is read could make a mapped page fault (SIGBUS)."""
        if not _CAN_MAP:
            return None
        total = sum(sizes)
        fd = _open_regular(self._path(name))
        try:
            if offset + total > os.fstat(fd).st_size:
                raise EOFError(f"{name}: file ends before byte {offset + total}")
            if not total:
                return [memoryview(b"") for _ in sizes]
            start = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(fd, offset + total - start, prot=mmap.PROT_READ, offset=start)
        finally:
            os.close(fd)  # the mapping keeps the file's pages
        whole = memoryview(mapping)[offset - start:]
        views, at = [], 0
        for size in sizes:
            views.append(whole[at: at + size])
            at += size
        return views

    def read_bytes(self, name: str) -> bytes:
        fd = _open_regular(self._path(name))
        try:
            size = os.fstat(fd).st_size  # what the file held when opened: memory bounded by its size
            data = bytearray(size)
            view, got = memoryview(data), 0
            while got < size and (n := os.preadv(fd, [view[got:]], got)):
                got += n
            return bytes(view[:got])
        finally:
            os.close(fd)

    def exists(self, name: str) -> bool:
        return os.path.exists(self._path(name))

    def size(self, name: str) -> int:
        """The size of a regular file; ``OSError`` for anything else (a link, a FIFO, a device)."""
        info = os.lstat(self._path(name))
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        return info.st_size

    def list_dir(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete_tree(self, prefix: str) -> None:
        path = self._path(prefix)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.unlink(path)


def _open_regular(path: str) -> int:
    fd = os.open(path, _READ_FLAGS)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd


def _write_chunks(fd: int, chunks: Iterable[memoryview]) -> None:
    """Small chunks gathered into one writev call, large ones written alone."""
    batch: list[memoryview] = []
    pending = 0
    for chunk in chunks:
        batch.append(_flat_bytes(chunk))
        pending += chunk.nbytes
        if len(batch) == _IOV_MAX or pending >= _WRITE_BATCH_BYTES:
            _write_all(fd, batch)
            batch, pending = [], 0
    _write_all(fd, batch)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # best effort: the write's own error is the one to report


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, views: list[memoryview]) -> None:
    views = [v for v in views if v.nbytes]
    while views:
        views = _advance(views, os.writev(fd, views[:_IOV_MAX]))


def _flat_bytes(view: memoryview) -> memoryview:
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _advance(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """What is left of ``views`` once ``nbytes`` of them are filled (a short read may stop mid-buffer)."""
    done = 0
    while done < len(views) and nbytes >= views[done].nbytes:
        nbytes -= views[done].nbytes
        done += 1
    rest = views[done:]
    if nbytes:
        rest[0] = rest[0][nbytes:]
    return rest
