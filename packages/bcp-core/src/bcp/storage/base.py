"""The storage interface: the few byte-level operations bcp needs, chosen so that an object store
(no rename, ranged reads, multipart uploads, conditional put) can provide every one of them.

Names are ``/``-separated strings relative to the storage root: they may become object keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Storage(Protocol):
    """Bytes in and out under one root (a directory, a bucket prefix, a memory namespace)."""

    root: str

    def write_file(self, name: str, chunks: Iterable[memoryview]) -> None:
        """Create or replace ``name`` with the concatenated chunks, durably (fsync or completed upload).
        A reader never sees a partially written file under this name only once the engine commits;
        the engine, not the backend, guarantees visibility through the commit marker."""

    def put_if_absent(self, name: str, data: bytes) -> bool:
        """Atomically create ``name`` holding ``data``; False if it already exists. Used for commit markers."""

    def read_into(self, name: str, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` with the bytes of ``name`` at ``offset``; raises ``EOFError`` if the file is shorter."""

    def read_into_many(self, name: str, offset: int, dests: Sequence[memoryview]) -> None:
        """Fill ``dests`` one after the other with the consecutive bytes of ``name`` from ``offset``
        (one vectored read where the backend has one); raises ``EOFError`` if the file is shorter."""
        for dest in dests:
            self.read_into(name, offset, dest)
            offset += dest.nbytes

    def read_bytes(self, name: str) -> bytes:
        """The whole content of a (small) file; ``FileNotFoundError`` if absent."""

    def exists(self, name: str) -> bool: ...

    def size(self, name: str) -> int: ...

    def list_dir(self, prefix: str) -> list[str]:
        """Immediate children (files and sub-prefixes) under ``prefix``, names only, sorted."""

    def delete_tree(self, prefix: str) -> None:
        """Remove everything under ``prefix``; absent is not an error."""


def streamed_from(storage: Storage) -> int | None:
    """The chunk size from which ``storage.write_file`` has written a chunk by the time it asks for
    the next one, so that the caller may reuse that chunk's memory; None where it may keep every
    chunk until the end (an upload retried whole, a join). A backend promises it with a
    ``streams_chunks_from`` attribute; smaller chunks may be gathered with the ones after them."""
    return getattr(storage, "streams_chunks_from", None)
