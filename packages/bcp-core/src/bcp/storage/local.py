"""Local or network (NFS) file system storage."""

from __future__ import annotations

import os
import shutil
from typing import Iterable

from bcp.storage.base import Storage


class LocalStorage(Storage):
    """Files under a directory. Writes are fsync'd (file and directory) before they return, reads
    use ``preadv`` straight into the caller's memory, so one file can be read by many threads."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.path.abspath(os.fspath(root))

    def _path(self, name: str) -> str:
        return os.path.join(self.root, *name.split("/")) if name else self.root

    def write_file(self, name: str, chunks: Iterable[memoryview]) -> None:
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for chunk in chunks:
                view = chunk.cast("B") if chunk.format != "B" or chunk.ndim != 1 else chunk
                while view.nbytes:
                    written = os.write(fd, view)
                    view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(os.path.dirname(path))

    def put_if_absent(self, name: str, data: bytes) -> bool:
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.tmp-{os.getpid()}"
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
        view = dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest
        fd = os.open(self._path(name), os.O_RDONLY)
        try:
            while view.nbytes:
                got = os.preadv(fd, [view], offset)
                if got == 0:
                    raise EOFError(f"{name}: file ends before byte {offset + view.nbytes}")
                view = view[got:]
                offset += got
        finally:
            os.close(fd)

    def read_bytes(self, name: str) -> bytes:
        with open(self._path(name), "rb") as f:
            return f.read()

    def exists(self, name: str) -> bool:
        return os.path.exists(self._path(name))

    def size(self, name: str) -> int:
        return os.path.getsize(self._path(name))

    def list_dir(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete_tree(self, prefix: str) -> None:
        path = self._path(prefix)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
