"""Staging of transactional loads: the reads fill host buffers, and only once every rank has read
and verified its share are the values placed into the live tensors.

Placing costs no copy where the live memory allows it. A host storage of bcp's allocator whose
bytes are mostly loaded (a parameter, or a flat buffer whose views are the loaded tensors) is staged
as a mirror: a buffer of the storage's size, each piece read at its own offset; placing copies the
bytes the load does not cover from the live storage into the mirror, then exchanges the two
storages' memory. The storage object, and every tensor and view on it, stays the one training
holds; only the memory under it changes. Everything else (pinned, shared or borrowed memory, such
as numpy's; casts; accelerator memory) is staged piece by piece and copied; accelerator tensors
from pinned buffers on bcp's copy stream (``device_copies``).

The buffers are reused by the next load (an exchange hands back the live storage's previous memory,
of the same size): repeated loads touch no fresh memory and host memory stays flat. The pool keeps
one load's worth, the last staged load's, until the runtime is closed. A load of another layout
frees the buffers it cannot use as soon as its own are allocated, so that it never holds two
layouts' staging at once; a load that stages nothing leaves them be.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import increment_version

from bcp.engine.device_copies import is_accelerator, pin_host, to_device
from bcp.layout.box import row_major_strides

# Private in torch (present since 2.3); without it every placement copies.
_CAN_EXCHANGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

Request = tuple[torch.Tensor, tuple[int, ...], torch.dtype]  # (live piece, shape, saved dtype)


class LoadStagingPool:
    """Host storages for staging, by size and pinning; keeps the last load's set between loads."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()

    def storage(self, nbytes: int, *, pinned: bool) -> torch.UntypedStorage:
        """A storage of exactly ``nbytes`` (reused when one is free)."""
        with self._lock:
            free = self._free.get((nbytes, pinned))
            storage = free.pop() if free else None
        if storage is None:
            storage = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        return storage

    def keep(self, storages: list[torch.UntypedStorage]) -> None:
        """After a load: these storages become the free set; older ones are dropped."""
        free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        for storage in storages:
            free.setdefault((storage.nbytes(), storage.is_pinned()), []).append(storage)
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
            return sum(nbytes * len(storages) for (nbytes, _), storages in self._free.items())


@dataclass(slots=True)
class _Mirror:
    """A live storage staged whole: ``staging`` has its size; ``spans`` are the byte ranges loaded."""

    live: torch.UntypedStorage
    staging: torch.UntypedStorage
    spans: list[tuple[int, int]]
    tensors: list[torch.Tensor] = field(default_factory=list)  # the live pieces, for their version counters


class Staging:
    """One load's staging: ``allocate`` makes the staging tensors (the load planner's allocator),
    ``place`` puts the values into the live tensors, ``release`` hands the buffers to the pool."""

    def __init__(self, pool: LoadStagingPool) -> None:
        self._pool = pool
        self._mirrors: list[_Mirror] = []
        self._storages: list[torch.UntypedStorage] = []

    def allocate(self, requests: list[Request]) -> list[torch.Tensor]:
        """A host tensor for each (live piece, shape, saved dtype): a view of its storage's mirror
        where the storage is mirrored, else a buffer of its own (pinned for accelerator pieces)."""
        out: list[torch.Tensor | None] = [None] * len(requests)
        for key, members in _mirrorable(requests).items():
            live = requests[members[0]][0].untyped_storage()
            mirror = _Mirror(live, self._pool.storage(live.nbytes(), pinned=False), [])
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
                storage = self._pool.storage(math.prod(shape) * dtype.itemsize,
                                             pinned=is_accelerator(tensor) and pin_host())
                self._storages.append(storage)
                out[i] = _tensor_on(storage, 0, shape, dtype)
        if requests:  # what is left is another layout's, which this load cannot use
            self._pool.clear()
        return out

    def place(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put each staging tensor's values into its live tensor, ``(live, staging)`` pairs: the
        mirrored storages by exchange, the rest by copy."""
        for mirror in self._mirrors:
            _fill_gaps(mirror)
            mirror.live._swap_data_ptr_(mirror.staging)
            for tensor in mirror.tensors:
                increment_version(tensor)  # autograd sees an in-place change, as a copy would make it
        mirrored = {id(t) for mirror in self._mirrors for t in mirror.tensors}
        to_accelerator = []
        for live, staging in pairs:
            if id(live) in mirrored:
                continue
            if is_accelerator(live) and staging.dtype == live.dtype:
                to_accelerator.append((live, staging))
            else:
                live.copy_(staging)
        to_device(to_accelerator)

    def release(self) -> None:
        """The buffers (after an exchange, the live tensors' previous memory) serve the next load; a
        load that staged nothing (``transactional=False``) leaves the pool's buffers to the next."""
        if self._storages:
            self._pool.keep(self._storages)
        self._mirrors, self._storages = [], []

    @property
    def exchanged(self) -> int:
        """How many live storages were (or will be) placed by exchanging memory."""
        return len(self._mirrors)


def _mirrorable(requests: list[Request]) -> dict[int, list[int]]:
    """Requests grouped by the live host storage they lie in, for the storages worth mirroring: of
    bcp's allocator (resizable: not borrowed from numpy or a file), neither pinned nor shared, each
    piece one run of bytes in the saved dtype, no two pieces overlapping, and at least half of the
    storage's bytes loaded (the rest is copied over when placing)."""
    if not _CAN_EXCHANGE:
        return {}
    groups: dict[int, list[int]] = {}
    for i, (tensor, _, dtype) in enumerate(requests):
        if tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.is_contiguous() and tensor.numel():
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
