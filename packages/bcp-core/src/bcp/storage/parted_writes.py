"""Large files written as separately retried parts while their bytes are still being produced.

A backend that can upload a file in parts (:class:`PartedWrites`: S3's multipart upload) gets the
file's bytes as the writer thread produces them (checksummed, compressed): :func:`part_bodies` cuts
that stream into part bodies, and the retrying layer sends each part as soon as it is cut, while
the writer thread goes on producing the next ones. A save then takes about as long as the longer of
producing and sending, not their sum, and holds the parts in flight and the one being cut rather
than the whole file.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from bcp.storage.names import flat_bytes


class PartedUpload(Protocol):
    """One file written as parts: :meth:`begin`, :meth:`send` each part (any order, ``parallel`` at
    once), :meth:`finish`; :meth:`abort` (best effort) if it cannot finish. Every step is one request,
    safe to repeat, so the retrying layer retries each on its own."""

    parallel: int
    """Parts worth sending at once (the store's cap on requests in flight)."""

    def begin(self) -> None: ...

    def send(self, index: int, body: Sequence[memoryview]) -> None:
        """Part ``index`` (from 0): the consecutive bytes of ``body``, the file's from
        ``index * part_bytes``."""

    def finish(self) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class PartedWrites(Protocol):
    """A backend that can write a large file as separately retried parts of ``part_bytes`` (the
    last one shorter); a file of one part it writes whole (``write_file``)."""

    part_bytes: int

    def parted_upload(self, name: str) -> PartedUpload:
        """The upload of ``name`` in parts, not yet begun."""


def part_bodies(views: Iterable[memoryview], part_bytes: int) -> Iterator[tuple[list[memoryview], bool]]:
    """The consecutive bytes of ``views`` as part bodies of ``part_bytes`` (the last one shorter, or
    empty for no bytes at all), each a list of views with whether it is the last. A body is cut
    once a byte after it has come, so a file of exactly one part is known to be one; views are
    drawn only as far as that needs. Bodies are views, not copies: a part's bytes are joined by the
    thread that sends it (:func:`joined`), not by the writer thread that produces the next."""
    held: list[memoryview] = []
    nbytes = 0
    for view in views:
        held.append(flat_bytes(view))
        nbytes += held[-1].nbytes
        while nbytes > part_bytes:
            body, held = _cut(held, part_bytes)
            nbytes -= part_bytes
            yield body, False
    yield held, True


def _cut(held: list[memoryview], nbytes: int) -> tuple[list[memoryview], list[memoryview]]:
    """The views of the first ``nbytes`` of ``held``, and of what follows them."""
    for index, view in enumerate(held):
        if view.nbytes >= nbytes:
            return [*held[:index], view[:nbytes]], [view[nbytes:], *held[index + 1:]]
        nbytes -= view.nbytes
    raise ValueError(f"fewer than {nbytes} bytes held")


def joined(views: Sequence[memoryview]) -> bytes:
    """The views' bytes as one ``bytes`` (the HTTP clients send it in one write); a whole ``bytes``
    object alone is not copied again."""
    if len(views) == 1 and isinstance(views[0].obj, bytes) and views[0].nbytes == len(views[0].obj):
        return views[0].obj
    return b"".join(views)
