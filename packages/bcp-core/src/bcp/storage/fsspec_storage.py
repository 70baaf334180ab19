"""Any fsspec filesystem (``gs://``, ``az://``, ``webhdfs://``, ...): the fallback for URL schemes
that have no backend of their own. Commit markers need the filesystem's exclusive-create mode
(``"xb"``); a filesystem without one cannot commit a checkpoint safely and says so."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from bcp.errors import StorageError
from bcp.storage.base import Storage
from bcp.storage.names import join_key
from bcp.storage.range_reads import RangeReads


class FsspecStorage(RangeReads, Storage):
    """Files under ``url`` on the fsspec filesystem its scheme names; ``options`` go to that filesystem."""

    def __init__(self, url: str, **options: Any) -> None:
        import fsspec.core

        self.root = url.rstrip("/")
        self._fs, self._base = fsspec.core.url_to_fs(url, **options)
        self._base = self._base.rstrip("/")

    def _path(self, name: str) -> str:
        joined = join_key(self._base, name)
        return f"/{joined}" if self._base.startswith("/") else joined

    def write_file(self, name: str, chunks: Iterable[memoryview]) -> None:
        path = self._path(name)
        self._fs.makedirs(self._fs._parent(path), exist_ok=True)
        with self._fs.open(path, "wb") as f:
            for chunk in chunks:
                f.write(chunk)

    def put_if_absent(self, name: str, data: bytes) -> bool:
        path = self._path(name)
        self._fs.makedirs(self._fs._parent(path), exist_ok=True)
        try:
            with self._fs.open(path, "xb") as f:
                f.write(data)
            return True
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError) as exc:
            raise StorageError(f"{type(self._fs).__name__} has no exclusive create, so a commit marker "
                               f"cannot be written safely: {exc}", path=self.root) from exc

    def read_range(self, name: str, offset: int, nbytes: int) -> list[bytes]:
        return [self._fs.cat_file(self._path(name), start=offset, end=offset + nbytes)]  # only these bytes

    def read_bytes(self, name: str) -> bytes:
        return self._fs.cat_file(self._path(name))

    def exists(self, name: str) -> bool:
        return self._fs.exists(self._path(name))

    def size(self, name: str) -> int:
        return self._fs.size(self._path(name))

    def list_dir(self, prefix: str) -> list[str]:
        path = self._path(prefix)
        if not self._fs.isdir(path):
            return []
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in self._fs.ls(path, detail=False))

    def delete_tree(self, prefix: str) -> None:
        path = self._path(prefix)
        if self._fs.exists(path):
            self._fs.rm(path, recursive=True)
