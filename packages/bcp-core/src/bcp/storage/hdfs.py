"""HDFS (``hdfs://namenode:port/path``) through pyarrow's ``HadoopFileSystem``.

HDFS has no exclusive-create call that pyarrow exposes, and pyarrow's ``move`` is no substitute:
when the destination is an existing *file* it deletes it and renames again (arrow's HDFS ``Move``
"allows file -> file clobber"). The commit marker is therefore written as a *directory*: the data
goes to ``<name>.claim-<random>/payload``, then that directory is renamed to ``<name>``. A directory
rename never clobbers: on HDFS, renaming onto an existing directory moves the source *into* it (the
loser sees its directory nested there and removes it); on a POSIX file system, ``rename(2)`` onto a
non-empty directory fails. Either way exactly one of several concurrent claimants creates ``<name>``,
atomically in the namenode (or the kernel). Reads of ``<name>`` read its ``payload``.

The same code runs over any pyarrow ``FileSystem`` given as ``filesystem``: the tests pass pyarrow's
``LocalFileSystem``, whose directory rename is ``rename(2)``, so the contract suite, exclusive
create included, runs here without a Hadoop cluster; a live cluster is tested when
``BCP_TEST_HDFS_URL`` is set.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlparse

from bcp.storage.names import join_key
from bcp.storage.range_reads import RangeReads

PAYLOAD = "payload"
"""The file inside a commit-marker directory that holds the marker's bytes."""
_CLAIM = ".claim-"


def _pyarrow_fs() -> Any:
    try:
        import pyarrow.fs
    except ImportError:
        raise ImportError("hdfs:// needs pyarrow (and a Hadoop client, libhdfs): pip install 'bcp-core[hdfs]'") from None
    return pyarrow.fs


class HdfsStorage(RangeReads):
    """Files under ``hdfs://namenode:port/path``; ``filesystem`` (any pyarrow ``FileSystem``) replaces
    the ``HadoopFileSystem`` the URL would open, the URL's path then naming the root in it."""

    def __init__(self, url: str, *, filesystem: Any = None) -> None:
        self.root = url.rstrip("/")
        fs = _pyarrow_fs()
        if filesystem is None:
            filesystem, path = fs.FileSystem.from_uri(url)
        else:
            path = urlparse(url).path
        self._fs = filesystem
        self._types = fs.FileType
        self._base = path.rstrip("/") or "/"

    def _path(self, name: str) -> str:
        return "/" + join_key(self._base, name)

    def _parent(self, path: str) -> None:
        self._fs.create_dir(path.rsplit("/", 1)[0] or "/", recursive=True)

    def _info(self, name: str) -> Any:
        return self._fs.get_file_info(self._path(name))

    def _file(self, name: str) -> str:
        """The file holding ``name``'s bytes: itself, or the payload of a commit-marker directory."""
        path = self._path(name)
        kind = self._info(name).type
        if kind == self._types.Directory:
            return f"{path}/{PAYLOAD}"
        if kind == self._types.NotFound:
            raise FileNotFoundError(2, "no such file", f"{self.root}/{name}")
        return path

    def write_file(self, name: str, chunks: Iterable[memoryview]) -> None:
        path = self._path(name)
        self._parent(path)
        with self._fs.open_output_stream(path) as out:
            for chunk in chunks:
                out.write(chunk)

    def put_if_absent(self, name: str, data: bytes) -> bool:
        path = self._path(name)
        claim = f"{path}{_CLAIM}{uuid.uuid4().hex}"
        self._parent(path)
        self._fs.create_dir(claim)
        with self._fs.open_output_stream(f"{claim}/{PAYLOAD}") as out:
            out.write(data)
        try:
            self._fs.move(claim, path)
        except OSError:  # POSIX: the name exists (a non-empty directory or a file)
            self._fs.delete_dir(claim)
            if self._fs.get_file_info(path).type == self._types.NotFound:
                raise
            return False
        nested = f"{path}/{claim.rsplit('/', 1)[-1]}"
        if self._fs.get_file_info(nested).type == self._types.Directory:  # HDFS: moved into the winner's
            self._fs.delete_dir(nested)
            return False
        return True

    def read_range(self, name: str, offset: int, nbytes: int) -> list[bytes]:
        with self._fs.open_input_file(self._file(name)) as f:
            return [f.read_at(min(nbytes, max(0, f.size() - offset)), offset)]  # one positional read

    def read_bytes(self, name: str) -> bytes:
        with self._fs.open_input_file(self._file(name)) as f:
            return f.readall()

    def exists(self, name: str) -> bool:
        return self._info(name).type != self._types.NotFound

    def size(self, name: str) -> int:
        return self._fs.get_file_info(self._file(name)).size

    def list_dir(self, prefix: str) -> list[str]:
        if self._info(prefix).type != self._types.Directory:
            return []
        selector = _pyarrow_fs().FileSelector(self._path(prefix), allow_not_found=True)
        names = (info.base_name for info in self._fs.get_file_info(selector))
        return sorted(n for n in names if _CLAIM not in n)  # claims in flight are not files yet

    def delete_tree(self, prefix: str) -> None:
        kind = self._info(prefix).type
        if kind == self._types.Directory:
            self._fs.delete_dir(self._path(prefix))
        elif kind != self._types.NotFound:
            self._fs.delete_file(self._path(prefix))
