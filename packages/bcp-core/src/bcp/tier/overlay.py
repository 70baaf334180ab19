"""The storage a rank reads a memory-tier generation through: the files its node folder holds, and
the byte ranges fetched from peers for the files it does not. Bytes fetched are checked against
their checksums by the reader like any others."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence

from bcp.storage import LocalStorage


class OverlayStorage:
    """Read-only: ``local`` serves the names in ``local_names``; every other name is served from the
    ranges :meth:`add` was given (``sizes``: the whole files' sizes, for the reader's checks)."""

    def __init__(self, local: LocalStorage, local_names: set[str], sizes: dict[str, int]) -> None:
        self.local = local
        self.root = local.root
        self.local_names = local_names
        self.sizes = sizes
        self._ranges: dict[str, list[tuple[int, memoryview]]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, offset: int, data: memoryview) -> None:
        with self._lock:
            ranges = self._ranges.setdefault(name, [])
            bisect.insort(ranges, (offset, data), key=lambda r: r[0])

    @property
    def fetched_bytes(self) -> int:
        return sum(data.nbytes for ranges in self._ranges.values() for _, data in ranges)

    def read_into(self, name: str, offset: int, dest: memoryview) -> None:
        self.read_into_many(name, offset, [dest])

    def read_into_many(self, name: str, offset: int, dests: Sequence[memoryview]) -> None:
        if name in self.local_names:
            self.local.read_into_many(name, offset, dests)
            return
        for dest in dests:
            dest = dest.cast("B")
            self._copy(name, offset, dest)
            offset += dest.nbytes

    def _copy(self, name: str, offset: int, dest: memoryview) -> None:
        ranges = self._ranges.get(name, [])
        i = bisect.bisect_right([start for start, _ in ranges], offset) - 1
        if i >= 0:
            start, data = ranges[i]
            if offset + dest.nbytes <= start + data.nbytes:
                dest[:] = data[offset - start:offset - start + dest.nbytes]
                return
        raise FileNotFoundError(f"{name}: bytes {offset}..{offset + dest.nbytes} are neither on this node "
                                "nor fetched from a peer")

    def read_bytes(self, name: str) -> bytes:
        return self.local.read_bytes(name)

    def exists(self, name: str) -> bool:
        return name in self.sizes or self.local.exists(name)

    def size(self, name: str) -> int:
        if name in self.local_names:
            return self.local.size(name)
        if name in self.sizes:
            return self.sizes[name]
        raise FileNotFoundError(name)

    def list_dir(self, prefix: str) -> list[str]:
        return self.local.list_dir(prefix)

    def write_file(self, name: str, chunks: Iterable[memoryview]) -> None:
        raise PermissionError(f"{name}: a memory tier generation is read-only while it is recovered")

    def put_if_absent(self, name: str, data: bytes) -> bool:
        raise PermissionError(f"{name}: a memory tier generation is read-only while it is recovered")

    def delete_tree(self, prefix: str) -> None:
        raise PermissionError(f"{prefix}: a memory tier generation is read-only while it is recovered")
