"""Reads for backends that fetch a byte range as whole buffers (object stores, fsspec, pyarrow):
the Storage protocol's two read methods built on one ``read_range`` per backend."""

from __future__ import annotations

from collections.abc import Sequence

from bcp.storage.names import scatter


class RangeReads:
    """Mixin: ``read_into``/``read_into_many`` over ``read_range``, which fetches only the wanted
    bytes; the fetched parts are scattered into the caller's buffers without joining them."""

    root: str

    def read_range(self, name: str, offset: int, nbytes: int) -> Sequence["bytes | bytearray | memoryview"]:
        """The bytes ``[offset, offset + nbytes)`` of ``name``, in one or more consecutive parts
        (fewer bytes where the file ends first)."""
        raise NotImplementedError

    def read_into(self, name: str, offset: int, dest: memoryview) -> None:
        self.read_into_many(name, offset, [dest])

    def read_into_many(self, name: str, offset: int, dests: Sequence[memoryview]) -> None:
        nbytes = sum(d.nbytes for d in dests)
        if not nbytes:
            return
        parts = self.read_range(name, offset, nbytes)
        if sum(len(memoryview(p).cast("B")) for p in parts) < nbytes:
            raise EOFError(f"{self.root}/{name}: file ends before byte {offset + nbytes}")
        scatter([memoryview(p) for p in parts], dests)
