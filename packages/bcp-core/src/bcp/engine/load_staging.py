"""Staging of transactional loads: the reads fill host buffers, and only once every rank has read
and verified its share are the values placed into the live tensors.

Placing costs no copy where the live memory allows it. A host storage of bcp's allocator whose
bytes are mostly loaded (a parameter, or a flat buffer whose views are the loaded tensors) is staged
as a mirror: a buffer of the storage's size, each piece read at its own offset; placing copies the
bytes the load does not cover from the live storage into the mirror, then exchanges the two
storages' memory. The storage object, and every tensor and view on it, stays the one training
holds; only the memory under it changes. Everything else (pinned, shared or borrowed memory, such
as numpy's; casts; accelerator memory) is staged piece by piece and copied.

Pieces in accelerator memory are staged in pageable host memory and copied to the device through
the pinned chunks (``chunked_copies``: the host fills chunk k+1 while chunk k goes to the device,
on bcp's copy stream): page-locking staging buffers of the state's size would cost the first load
about a second per few GB, more than the copies it speeds up. A load that is not transactional
may write live tensors before every rank has read, so there each staged piece goes to its live
tensor as soon as its reads are done, on a thread of the load, while the reads after it go on.

The buffers are reused by the next load (an exchange hands back the live storage's previous memory,
of the same size): repeated loads touch no fresh memory and host memory stays flat. The pool keeps
one load's worth, the last staged load's, until the runtime is closed. A load of another layout
frees the buffers it cannot use as soon as its own are allocated, so that it never holds two
layouts' staging at once; a load that stages nothing leaves them be.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import increment_version

from bcp.engine.chunked_copies import ChunkedCopies
from bcp.layout.box import row_major_strides
from bcp.layout.read_op import ReadOp
from bcp.torch_internals.tensors import can_exchange_storages, exchange_storages

_CAN_EXCHANGE = can_exchange_storages()  # without it every placement copies

Request = tuple[torch.Tensor, tuple[int, ...], torch.dtype]  # (live piece, shape, saved dtype)


class LoadStagingPool:
    """Host storages for staging, by size; keeps the last load's set between loads."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()

    def storage(self, nbytes: int) -> torch.UntypedStorage:
        """A storage of exactly ``nbytes`` (reused when one is free)."""
        with self._lock:
            free = self._free.get(nbytes)
            storage = free.pop() if free else None
        if storage is None:
            storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
        return storage

    def keep(self, storages: list[torch.UntypedStorage]) -> None:
        """After a load: these storages become the free set; older ones are dropped."""
        free: dict[int, list[torch.UntypedStorage]] = {}
        for storage in storages:
            free.setdefault(storage.nbytes(), []).append(storage)
        with self._lock:
            self._free = free

    def clear(self) -> None:
        """Drop the free buffers."""
        with self._lock:
            self._free = {}

    @property
    def held_bytes(self) -> int:
        """Host memory the free buffers hold."""
        with self._lock:
            return sum(nbytes * len(storages) for nbytes, storages in self._free.items())


@dataclass(slots=True)
class _Mirror:
    """A live storage staged whole: ``staging`` has its size; ``spans`` are the byte ranges loaded."""

    live: torch.UntypedStorage
    staging: torch.UntypedStorage
    spans: list[tuple[int, int]]
    tensors: list[torch.Tensor] = field(default_factory=list)  # the live pieces, for their version counters


class Staging:
    """One load's staging: ``allocate`` makes the staging tensors (the load planner's allocator),
    ``place`` puts the values into the live tensors, ``release`` hands the buffers to the pool.
    Pieces in accelerator memory reach it through ``copies``."""

    def __init__(self, pool: LoadStagingPool, copies: ChunkedCopies) -> None:
        self._pool = pool
        self._copies = copies
        self._mirrors: list[_Mirror] = []
        self._storages: list[torch.UntypedStorage] = []
        self._placer: ThreadPoolExecutor | None = None
        self._placing: list[Future] = []
        self._placed: set[int] = set()  # ids of the staging tensors placed as soon as they were read
        self._previous: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live, its bytes before an undoable place)
        self._exchanged: list[_Mirror] = []  # the mirrors place() exchanged so far, for unplace()

    def in_host_memory(self, tensor: torch.Tensor) -> bool:
        """Whether reads may land in ``tensor`` itself: host memory, not an accelerator's."""
        return tensor.device.type == "cpu" and not self._copies.holds(tensor)

    def allocate(self, requests: list[Request]) -> list[torch.Tensor]:
        """A host tensor for each (live piece, shape, saved dtype): a view of its storage's mirror
        where the storage is mirrored, else a buffer of its own. Called on the thread that loads:
        copies into accelerator tensors follow the work their devices' streams hold now."""
        out: list[torch.Tensor | None] = [None] * len(requests)
        for key, members in _mirrorable(requests, self.in_host_memory).items():
            live = requests[members[0]][0].untyped_storage()
            mirror = _Mirror(live, self._pool.storage(live.nbytes()), [])
            for i in members:
                tensor, shape, dtype = requests[i]
                start = tensor.storage_offset() * tensor.element_size()
                mirror.spans.append((start, start + tensor.numel() * tensor.element_size()))
                mirror.tensors.append(tensor)
                out[i] = _tensor_on(mirror.staging, start, shape, dtype)
            self._mirrors.append(mirror)
            self._storages.append(mirror.staging)
        for i, (tensor, shape, dtype) in enumerate(requests):
            if out[i] is None:
                storage = self._pool.storage(math.prod(shape) * dtype.itemsize)
                self._storages.append(storage)
                out[i] = _tensor_on(storage, 0, shape, dtype)
        self._copies.follow([tensor for tensor, _, _ in requests])
        if requests:  # what is left is another layout's, which this load cannot use
            self._pool.clear()
        return out

    def place_as_read(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                      ops: list[ReadOp]) -> Callable[[ReadOp], None] | None:
        """For a load that is not transactional: the reader's ``on_done`` for ``ops``, which places
        each staged piece of ``(live, staging)`` pairs as soon as every read into it is done, on a
        thread of this load, while the reads after it go on. :meth:`place` places the rest."""
        if not pairs:
            return None
        by_staging = {id(staging): (live, staging) for live, staging in pairs}
        left: dict[int, int] = {}
        for op in ops:
            if id(op.piece.tensor) in by_staging:
                left[id(op.piece.tensor)] = left.get(id(op.piece.tensor), 0) + 1
        lock = threading.Lock()
        self._placer = placer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcp-place")

        def done(op: ReadOp) -> None:
            key = id(op.piece.tensor)
            with lock:
                if key not in left:
                    return
                left[key] -= 1
                if left[key]:
                    return
                del left[key]
                self._placed.add(key)
                self._placing.append(placer.submit(self._copy_into_live, [by_staging[key]]))
        return done

    def place(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], *, undoable: bool = False) -> None:
        """Put each staging tensor's values into its live tensor, ``(live, staging)`` pairs: the
        mirrored storages by exchange, the rest by copy (those placed as they were read are). With
        ``undoable``, :meth:`unplace` can give the live tensors their previous bytes back until
        :meth:`release`: an exchange keeps the previous memory anyway, a copied piece's previous
        bytes are copied to host memory first."""
        self._stop_placing()
        for future in self._placing:
            future.result()
        for mirror in self._mirrors:
            _fill_gaps(mirror)
            _exchange(mirror)
            self._exchanged.append(mirror)
        mirrored = {id(t) for mirror in self._mirrors for t in mirror.tensors}
        copied = [(live, staging) for live, staging in pairs
                  if id(live) not in mirrored and id(staging) not in self._placed]
        if undoable:
            self._previous = [(live, live.to("cpu", copy=True)) for live, _ in copied]
        try:
            self._copy_into_live(copied)
        finally:  # copies in flight on a side stream land before anything (an unplace) follows
            self._copies.hand_over()

    def unplace(self) -> None:
        """Give the live tensors placed by an undoable :meth:`place` the bytes they held before it,
        also where that place failed part way (only what it exchanged is exchanged back)."""
        for mirror in reversed(self._exchanged):
            _exchange(mirror)  # the staging storage holds the live one's previous memory, untouched
        self._exchanged = []
        for live, previous in self._previous:
            live.copy_(previous)
        self._previous = []

    def release(self) -> None:
        """The buffers (after an exchange, the live tensors' previous memory) serve the next load; a
        load that staged nothing (``transactional=False``) leaves the pool's buffers to the next."""
        self._stop_placing()
        if self._storages:
            self._pool.keep(self._storages)
        self._mirrors, self._storages, self._placing, self._placed = [], [], [], set()
        self._previous, self._exchanged = [], []

    def _copy_into_live(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        to_device = []
        for live, staging in pairs:
            if self._copies.holds(live) and staging.dtype == live.dtype:
                to_device.append((live, staging))
            else:
                live.copy_(staging)
        self._copies.to_device(to_device)

    def _stop_placing(self) -> None:
        """Wait for the placements made as reads were done."""
        if self._placer is not None:
            self._placer.shutdown(wait=True)
            self._placer = None

    @property
    def exchanged(self) -> int:
        """How many live storages were (or will be) placed by exchanging memory."""
        return len(self._mirrors)


def _mirrorable(requests: list[Request], in_host_memory: Callable[[torch.Tensor], bool]) -> dict[int, list[int]]:
    """Requests grouped by the live host storage they lie in, for the storages worth mirroring: of
    bcp's allocator (resizable: not borrowed from numpy or a file), neither pinned nor shared, each
    piece one run of bytes in the saved dtype, no two pieces overlapping, and at least half of the
    storage's bytes loaded (the rest is copied over when placing)."""
    if not _CAN_EXCHANGE:
        return {}
    groups: dict[int, list[int]] = {}
    for i, (tensor, _, dtype) in enumerate(requests):
        if in_host_memory(tensor) and tensor.dtype == dtype and tensor.is_contiguous() and tensor.numel():
            groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(i)
    chosen = {}
    for key, members in groups.items():
        first = requests[members[0]][0]
        storage = first.untyped_storage()
        if not storage.resizable() or storage.is_shared() or first.is_pinned():
            continue
        spans = sorted((t.storage_offset() * t.element_size(), (t.storage_offset() + t.numel()) * t.element_size())
                       for t, _, _ in (requests[i] for i in members))
        if any(end > start for (_, end), (start, _) in zip(spans, spans[1:])):
            continue  # overlapping pieces (a tensor loaded twice, as tied weights are)
        if 2 * sum(end - start for start, end in spans) >= storage.nbytes():
            chosen[key] = members
    return chosen


def _exchange(mirror: _Mirror) -> None:
    exchange_storages(mirror.live, mirror.staging)
    for tensor in mirror.tensors:
        increment_version(tensor)  # autograd sees an in-place change, as a copy would make it


def _fill_gaps(mirror: _Mirror) -> None:
    """Copy the live storage's bytes that the load does not cover into the mirror."""
    live, staging = _bytes_of(mirror.live), _bytes_of(mirror.staging)
    at = 0
    for start, end in sorted(mirror.spans) + [(live.numel(), live.numel())]:
        if start > at:
            staging[at:start].copy_(live[at:start])
        at = max(at, end)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _tensor_on(storage: torch.UntypedStorage, start: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` at byte ``start`` of ``storage``."""
    return torch.empty(0, dtype=dtype).set_(storage, start // dtype.itemsize, shape, row_major_strides(shape))
