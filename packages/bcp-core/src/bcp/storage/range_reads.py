"""Reads for backends that fetch a byte range as whole buffers (object stores, fsspec, pyarrow):
the Storage protocol's two read methods built on one ``read_range`` per backend, and views of the
fetched buffers themselves (``read_views``) for a reader that only looks at the bytes."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, Union, runtime_checkable

from bcp.storage.names import flat_bytes, scatter

Buffer = Union[bytes, bytearray, memoryview]
"""What a backend fetches: any bytes-like object."""


@runtime_checkable
class ViewReads(Protocol):
    """A storage that can hand out the buffers it fetched instead of copying them into the caller's
    memory: a reader that verifies bytes and copies parts of them elsewhere (a resharded load) then
    saves one copy of every byte."""

    def read_views(self, name: str, offset: int, sizes: Sequence[int]) -> list[memoryview] | None:
        """The consecutive byte ranges of ``sizes`` from ``offset`` of ``name``, one view each, not to
        be written (``EOFError`` if the file ends first); None where this storage has no buffers of
        its own to hand out (the caller then reads into its own memory)."""


@runtime_checkable
class StreamedReads(Protocol):
    """A storage that can hand a read's bytes over as they arrive: a reader that decodes stored
    chunks then decodes the first ones while the rest are still on their way, where it would
    otherwise wait for the whole request before decoding any."""

    def read_streamed(self, name: str, offset: int, dest: memoryview, arrived: Callable[[int], None]) -> bool:
        """Read ``dest.nbytes`` bytes from ``offset`` of ``name`` into ``dest``, calling ``arrived(n)``
        (on the calling thread, quickly) each time the first ``n`` bytes of ``dest`` are in place
        (``EOFError`` if the file ends first); False, having read nothing, where this storage would
        not read that range in one request (the caller then reads it otherwise). A retried read
        starts over: ``n`` may then go down again, over the same bytes."""


class RangeReads:
    """Mixin: ``read_into``/``read_into_many``/``read_views`` over ``read_range``, which fetches only
    the wanted bytes; the fetched parts are scattered into the caller's buffers without joining them,
    or handed out as they are."""

    root: str

    def read_range(self, name: str, offset: int, nbytes: int) -> Sequence[Buffer]:
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

    def read_views(self, name: str, offset: int, sizes: Sequence[int]) -> list[memoryview] | None:
        parts = self.read_range(name, offset, sum(sizes))
        return cut_views(parts, sizes, lambda end: f"{self.root}/{name}: file ends before byte {offset + end}")


def cut_views(parts: Sequence[Buffer], sizes: Sequence[int], short: Callable[[int], str]) -> list[memoryview]:
    """Consecutive fetched ``parts`` as one view per size: a slice of its part, or, for a size that
    straddles parts, their bytes joined (a copy); ``EOFError(short(end))`` where the parts end before
    byte ``end`` of the sizes."""
    pending = deque(flat_bytes(memoryview(p)) for p in parts)
    views: list[memoryview] = []
    end = 0
    for size in sizes:
        end += size
        while pending and not pending[0].nbytes:
            pending.popleft()
        if pending and pending[0].nbytes >= size:
            views.append(pending[0][:size])
            pending[0] = pending[0][size:]
            continue
        joined, filled = bytearray(size), 0
        while filled < size:
            if not pending:
                raise EOFError(short(end))
            step = min(size - filled, pending[0].nbytes)
            joined[filled:filled + step] = pending[0][:step]
            pending[0] = pending[0][step:]
            filled += step
            if not pending[0].nbytes:
                pending.popleft()
        views.append(memoryview(joined))
    return views


def request_spans(offset: int, nbytes: int, limit: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the requests that fetch ``nbytes`` from ``offset`` of a file: as few as
    ``limit`` bytes per request allows, cut at multiples of ``limit`` in the file (where the parts
    of a multipart upload of ``limit``-byte parts end), a short piece at either end joined to its
    neighbour while that keeps the count.

    Requests, more than bytes, set the pace of a load from an object store: ending each request
    where a run of the caller's views ends would add a short one to most runs (a 62 MiB run of
    3.5 MiB views: 5 GETs instead of 4). Cutting where the stored parts end spares a server that
    keeps each part apart (SeaweedFS, as chunks) from reading two parts for one GET."""
    if nbytes <= 0:
        return []
    end = offset + nbytes
    cuts = list(range((offset // limit + 1) * limit, end, limit))
    count = -(-nbytes // limit)
    while len(cuts) > count - 1:  # drop the cut that bounds the shorter end piece
        cuts.pop(0 if cuts[0] - offset <= end - cuts[-1] else -1)
    bounds = [offset, *cuts, end]
    return list(zip(bounds, bounds[1:]))
