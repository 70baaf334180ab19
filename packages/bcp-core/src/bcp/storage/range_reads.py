"""Reads for backends that fetch a byte range as whole buffers (object stores, fsspec, pyarrow):
the Storage protocol's two read methods built on one ``read_range`` per backend, and views of the
fetched buffers themselves (``read_views``) for a reader that only looks at the bytes."""

from __future__ import annotations

import bisect
import itertools
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


def request_spans(offset: int, sizes: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the requests that fetch the consecutive ``sizes`` from ``offset``: as few
    as ``limit`` bytes per request allows, of about even length, each cut where a size ends if one
    ends within ``limit // 8`` of the even cut (no view then straddles two requests), else at the
    even cut. Each request fetches at most ``limit`` bytes plus that slack on both ends.

    Cutting where sizes end without evening out (a request ending at the last size that fits under
    ``limit``) costs a short request at the end of most runs of sizes: a 62 MiB run of 4 MiB sizes
    took 5 requests instead of 4, and requests, not bytes, set the pace of a load from S3."""
    total = sum(sizes)
    if not total:
        return []
    count = -(-total // limit)
    ends = list(itertools.accumulate(sizes))
    slack = limit // 8
    cuts = [0]
    for k in range(1, count):
        even = k * total // count
        at = bisect.bisect_left(ends, even)
        near = [e for e in ends[max(at - 1, 0):at + 1] if cuts[-1] < e < total and abs(e - even) <= slack]
        cuts.append(min(near, key=lambda e: abs(e - even)) if near else even)
    cuts.append(total)
    return [(offset + low, offset + high) for low, high in zip(cuts, cuts[1:])]
