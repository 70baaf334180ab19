"""Copies between accelerator memory and host memory in fixed-size chunks, through a few pinned host
buffers: the copies of the next chunks are queued while the host works on the current one, so the
device copy overlaps the host's work and host memory holds a few chunks, never the tensors' size.

- :meth:`ChunkedCopies.write_views`: a synchronous save writes device tensors chunk by chunk; the
  writer thread checksums and writes chunk k while chunks k+1 and k+2 come from the device.
- :meth:`ChunkedCopies.to_host`: device tensors into host memory. Pinned memory (a staging buffer
  once registered) takes them directly; memory that is not pinned (a staging buffer's first save)
  through the chunks: the host copies chunk k into place while the device copies the ones after it.
- :meth:`ChunkedCopies.to_device`: host memory into device tensors (a load's staged bytes): from
  memory that is not pinned, the host copies chunk k+1 into a pinned chunk while chunk k goes to the
  device.

Pinning is slow (4.5 GiB took 3.4-5.2 s on an H200 machine, a second or more per few GB
everywhere), so the chunks come from one pool per process (:class:`PinnedChunks`, in the runtime)
that keeps them from one operation to the next: a process pays for them once.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Union

import torch

from bcp.engine.bytes_of import byte_view, host_contiguous
from bcp.engine.device_copies import Accelerator, CopyQueue, Landing, TorchAccelerator
from bcp.layout.box import flat_range_to_boxes

#: Bytes per pinned chunk: a write of this size streams at the disk's speed, and at 50 GB/s its
#: device copy takes a third of a millisecond.
CHUNK_BYTES = 16 << 20
#: Chunks queued beyond the one in use. A chunk's device copy takes a small fraction of the time
#: its write takes, so two ahead keep the host from waiting for the device, and each pipeline
#: (one per writer thread) holds at most three chunks.
AHEAD = 2

#: What a save writes: a tensor (in host or device memory), a function that produces one when the
#: writer reaches it (the tools' streamed pieces), or parts of bytes in host memory (a value record).
Source = Union[torch.Tensor, Callable[[], torch.Tensor], tuple[memoryview, ...]]
Pair = tuple[torch.Tensor, torch.Tensor]  # (destination, source)


class PinnedChunks:
    """Pinned host buffers of ``chunk_bytes`` each, shared by every copy of a process and kept
    between operations. The pool holds as many as were ever in use at once: a few per thread that
    copied (``held_bytes``); :meth:`clear` gives them back (to torch's pinned-memory cache, which
    ``torch.accelerator.empty_host_cache()`` empties)."""

    def __init__(self, accelerator: Accelerator, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.accelerator = accelerator
        self.chunk_bytes = chunk_bytes
        self._free: list[torch.Tensor] = []
        self._count = 0
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        """A free chunk, or a new one when every chunk is in use."""
        with self._lock:
            if self._free:
                return self._free.pop()
            self._count += 1
        try:
            return self.accelerator.pinned_empty(self.chunk_bytes)
        except BaseException:
            with self._lock:
                self._count -= 1
            raise

    def give(self, chunk: torch.Tensor) -> None:
        """Return a chunk that no copy uses any more."""
        with self._lock:
            self._free.append(chunk)

    def clear(self) -> None:
        """Drop the free chunks (call it when no copy is running)."""
        with self._lock:
            self._count -= len(self._free)
            self._free = []

    @property
    def held_bytes(self) -> int:
        """Pinned host memory the pool's chunks hold, in use or free."""
        with self._lock:
            return self._count * self.chunk_bytes


@dataclass(slots=True)
class _Chunk:
    """A chunk queued for a copy from the device: ``nbytes`` of ``buffer`` once ``landing`` is done."""

    source: int
    offset: int
    buffer: torch.Tensor
    nbytes: int
    landing: Landing


class _SourceWalk:
    """The sources of one :meth:`ChunkedCopies.write_views` as the writer reaches them: a source
    produced on demand is made only once the writer reaches it (and released when it moves on), so
    the device chunks queued ahead of the writer stop at such a source until then."""

    def __init__(self, sources: Sequence[Source]) -> None:
        self._sources = sources
        self._produced: list = [None] * len(sources)
        self._reached = 0

    def reach(self, index: int) -> Source:
        """The writer is at source ``index``: its tensor or bytes (produced now where it is made on demand)."""
        self._reached = index
        source = self._sources[index]
        item = self._produced[index] = source() if callable(source) else source
        return item

    def release(self, index: int) -> None:
        """The writer is done with source ``index``: a produced tensor is let go before the next is made."""
        self._produced[index] = None

    def device_chunks(self, holds: Callable[[torch.Tensor], bool],
                      step: int) -> Iterator[tuple[int, int, list[torch.Tensor]] | None]:
        """The device tensors' chunks in order, as (source index, offset, views); None while the
        next source is one produced on demand that the writer has not reached."""
        for index, source in enumerate(self._sources):
            if callable(source):
                while self._reached < index:
                    yield None
                source = self._produced[index]
            if isinstance(source, torch.Tensor) and holds(source):
                for offset, parts in _chunks_of(source, step):
                    yield index, offset, parts


class ChunkedCopies:
    """One operation's copies between accelerator memory and host memory, through the process's
    pinned chunks. Make it on the thread that produced the tensors (or will use them), naming
    them: each device's copies are ordered after the work its current stream holds then."""

    def __init__(self, chunks: PinnedChunks, tensors: Sequence[torch.Tensor] = ()) -> None:
        self.accelerator = chunks.accelerator
        self._chunks = chunks
        self._queues: dict[torch.device, CopyQueue] = {}
        self._lock = threading.Lock()
        self.follow(tensors)

    def follow(self, tensors: Sequence[torch.Tensor]) -> None:
        """Order the copies to and from the devices of ``tensors`` after the work their current
        streams hold now (on this thread); a device met later is followed from where it is met."""
        for tensor in tensors:
            if self.accelerator.holds(tensor):
                self._queue(tensor.device)

    @staticmethod
    def for_host() -> "ChunkedCopies":
        """Copies for writers whose tensors are in host memory (a device tensor met all the same
        goes through chunks of its own)."""
        return ChunkedCopies(PinnedChunks(TorchAccelerator()))

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in accelerator memory (it is copied through here)."""
        return self.accelerator.holds(tensor)

    def write_views(self, sources: Sequence[Source], *, multiple_of: int,
                    reused_from: int | None) -> Iterator[tuple[int, memoryview]]:
        """Each source's bytes in host memory, in order, as ``(source index, view)``: a host tensor
        in one view, parts of bytes one view each, a device tensor one chunk at a time (a multiple
        of ``multiple_of`` bytes but the last), at least one view per source (empty for no bytes).

        A chunk's memory is reused once the caller asks for the view after it, so the caller must
        be done with a view by then: ``reused_from`` is the size from which it is (the storage's
        promise, ``storage.base.streamed_from``); a smaller chunk, or any with ``reused_from``
        None, is handed over as a copy of its own."""
        step = multiple_of * max(1, self._chunks.chunk_bytes // multiple_of)
        walk = _SourceWalk(sources)
        jobs = walk.device_chunks(self.holds, step)
        ahead: deque[_Chunk] = deque()
        try:
            for index in range(len(sources)):
                item = walk.reach(index)
                if isinstance(item, tuple):
                    for part in item or (memoryview(b""),):
                        yield index, part
                elif not self.holds(item) or not item.numel():
                    yield index, byte_view(host_contiguous(item))
                else:
                    for _ in range(-(-item.numel() * item.element_size() // step)):
                        self._queue_ahead(ahead, jobs)
                        chunk = ahead[0]
                        chunk.landing.synchronize()
                        data = chunk.buffer[: chunk.nbytes]
                        if reused_from is None or chunk.nbytes < reused_from:
                            data = data.clone()
                        yield index, byte_view(data)
                        self._chunks.give(ahead.popleft().buffer)
                item = None
                walk.release(index)
        finally:
            self._give_back([chunk.buffer for chunk in ahead], [chunk.landing for chunk in ahead])

    def to_host(self, pairs: Sequence[Pair]) -> None:
        """Copy device tensors into contiguous host tensors, ``(host, device)`` pairs; returns once
        the bytes are there. Pinned destinations take the device's copies directly; others go
        through the chunks, the host copying chunk k into place while the device copies the next."""
        direct = [self._queue(device.device).copy(host, device) for host, device in pairs
                  if self.accelerator.is_pinned(host)]
        bounced = [(_bytes(host), device) for host, device in pairs if not self.accelerator.is_pinned(host)]
        jobs = ((i, offset, parts) for i, (_, device) in enumerate(bounced)
                for offset, parts in _chunks_of(device, self._chunks.chunk_bytes))
        ahead: deque[_Chunk] = deque()
        try:
            while self._queue_ahead(ahead, jobs) or ahead:
                chunk = ahead[0]
                chunk.landing.synchronize()
                host = bounced[chunk.source][0]
                host[chunk.offset: chunk.offset + chunk.nbytes].copy_(chunk.buffer[: chunk.nbytes])
                self._chunks.give(ahead.popleft().buffer)
        finally:
            self._give_back([chunk.buffer for chunk in ahead], [chunk.landing for chunk in ahead] + direct)

    def to_device(self, pairs: Sequence[Pair]) -> None:
        """Copy contiguous host tensors into device tensors of the same dtype, ``(device, host)``
        pairs; returns once the host tensors may change (:meth:`hand_over` orders the device's
        work after the copies). Pinned sources are copied directly; others through the chunks, the
        host filling chunk k+1 while chunk k goes to the device."""
        landings: list[Landing] = []
        in_flight: deque[tuple[torch.Tensor, Landing]] = deque()
        try:
            for device, host in pairs:
                queue = self._queue(device.device)
                if self.accelerator.is_pinned(host):
                    landings.append(queue.copy(device, host))
                    continue
                source = _bytes(host)
                for offset, parts in _chunks_of(device, self._chunks.chunk_bytes):
                    buffer = self._free_chunk(in_flight)
                    nbytes = sum(_nbytes(part) for part in parts)
                    buffer[:nbytes].copy_(source[offset: offset + nbytes])
                    in_flight.append((buffer, self._copy_parts(queue, parts, buffer, to_host=False)))
        finally:
            self._give_back([buffer for buffer, _ in in_flight], [landing for _, landing in in_flight] + landings)

    def hand_over(self) -> None:
        """Each device's current stream (as it was when this was made) waits for the copies."""
        with self._lock:
            queues = list(self._queues.values())
        for queue in queues:
            queue.hand_over()

    def _queue(self, device: torch.device) -> CopyQueue:
        with self._lock:
            queue = self._queues.get(device)
            if queue is None:
                queue = self._queues[device] = self.accelerator.open_queue(device)
            return queue

    def _queue_ahead(self, ahead: deque[_Chunk], jobs: Iterator) -> bool:
        """Queue chunk copies until ``AHEAD`` wait beyond the one in use; whether any was queued."""
        queued = False
        while len(ahead) <= AHEAD and (job := next(jobs, None)) is not None:
            source, offset, parts = job
            buffer = self._chunks.take()
            try:
                landing = self._copy_parts(self._queue(parts[0].device), parts, buffer, to_host=True)
            except BaseException:
                self._chunks.give(buffer)
                raise
            ahead.append(_Chunk(source, offset, buffer, sum(_nbytes(part) for part in parts), landing))
            queued = True
        return queued

    def _free_chunk(self, in_flight: deque[tuple[torch.Tensor, Landing]]) -> torch.Tensor:
        """A chunk to fill: the oldest in flight once it has landed, when ``AHEAD`` + 1 are."""
        if len(in_flight) <= AHEAD:
            return self._chunks.take()
        buffer, landing = in_flight.popleft()
        try:
            landing.synchronize()
        except BaseException:
            self._chunks.give(buffer)
            raise
        return buffer

    @staticmethod
    def _copy_parts(queue: CopyQueue, parts: list[torch.Tensor], buffer: torch.Tensor, *, to_host: bool) -> Landing:
        """Queue the copies between a chunk's device views and consecutive bytes of ``buffer``."""
        landing, at = None, 0
        for part in parts:
            host = buffer[at: at + _nbytes(part)].view(part.dtype).view(part.shape)
            landing = queue.copy(host, part) if to_host else queue.copy(part, host)
            at += _nbytes(part)
        return landing

    def _give_back(self, buffers: list[torch.Tensor], landings: list[Landing]) -> None:
        """Wait for the copies still running, then return their chunks to the pool; the first error
        of a copy is raised once every copy has been waited for."""
        error = None
        for landing in landings:
            try:
                landing.synchronize()
            except BaseException as exc:  # noqa: BLE001 - raised below, after the others are waited for
                error = error or exc
        for buffer in buffers:
            self._chunks.give(buffer)
        if error is not None:
            raise error


def _chunks_of(tensor: torch.Tensor, nbytes: int) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """The tensor's elements in row-major order, ``nbytes`` at a time: each chunk's byte offset and
    the views of the tensor that hold it (one where the tensor is contiguous, at most
    ``2 * ndim - 1`` where it is strided, each of them a run of consecutive elements)."""
    size = tensor.element_size()
    if nbytes % size:
        raise ValueError(f"chunks of {nbytes} bytes do not hold whole elements of {tensor.dtype}")
    per, total = nbytes // size, tensor.numel()
    flat = tensor.reshape(-1) if tensor.is_contiguous() else None
    for start in range(0, total, per):
        length = min(per, total - start)
        if flat is not None:
            yield start * size, [flat[start: start + length]]
        else:
            yield start * size, [tensor[box.slices()] for box, _ in flat_range_to_boxes(tensor.shape, start, length)]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor's bytes as a flat uint8 tensor (its own memory)."""
    return tensor.reshape(-1).view(torch.uint8)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()

