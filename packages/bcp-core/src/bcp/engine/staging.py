"""Staging for asynchronous saves: the pieces a rank writes are copied into reusable host buffers,
so training may change its tensors as soon as ``save`` returns.

A pool keeps at most ``max_sets`` buffers (ping-pong: the next save stages into one buffer while
the previous save is still writing from the other) and reuses them across saves, so host memory
stays flat. A shared pool's buffers are shared memory (``shared_memory``), which the writer process
reads from.

Tensors in accelerator memory are copied on bcp's copy stream after the work queued so far
(``device_copies``): staging waits for those copies only, not for every kernel training has
queued. They copy fastest into page-locked (pinned) memory, but page-locking a buffer the size of
the state costs about a second per few GB, which the first save would pay on the training thread.
So a buffer starts pageable: its first save copies through the pool of pinned chunks
(``chunked_copies``: the host moves chunk k into place while the device copies chunk k+1), and
once that save's write is done a thread of the pool page-locks (registers) the buffer, so the
saves after it copy straight into it.

A save staged elsewhere (a memory tier's, into the files of its new generation: ``staging_files``)
holds one of the pool's ``max_sets`` places without a buffer (:meth:`HostBufferPool.hold_place`),
so that no more saves are staged at once than the pool allows, whatever they stage in; the pool
keeps those files too (``files``).
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import torch

from bcp.engine.chunked_copies import ChunkedCopies, Pair
from bcp.engine.device_copies import Accelerator
from bcp.engine.shared_memory import SharedHostBuffer
from bcp.engine.staging_files import StagingFiles
from bcp.layout.write_plan import PieceWrite

ALIGN = 64  # every staged piece starts on a 64-byte boundary: any dtype view of it is aligned

logger = logging.getLogger("bcp")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def staged_nbytes(writes: list[PieceWrite]) -> int:
    return sum(_aligned(w.nbytes) for w in writes)


class HostBufferPool:
    """Reusable host buffers; ``acquire`` blocks while ``max_sets`` buffers are in use. With
    ``shared``, every buffer is shared memory (:meth:`shared_of` gives its descriptor). A buffer
    that took copies from the ``accelerator`` is page-locked by it after that use, on a thread of
    the pool (:meth:`release`)."""

    def __init__(self, max_sets: int = 2, shared: bool = False, accelerator: Accelerator | None = None) -> None:
        self.max_sets = max_sets
        self.shared = shared
        self.accelerator = accelerator
        self._free: list[torch.Tensor] = []
        self._in_use = 0
        self._allocated = 0
        self._shared: dict[int, SharedHostBuffer] = {}  # id(tensor) -> its shared memory
        #: id(tensor) -> (bytes page-locked, 0 where refused; the device it was registered for), once tried
        self._registered: dict[int, tuple[int, torch.device]] = {}
        self._registering: list[threading.Thread] = []
        self._cond = threading.Condition()
        #: The files saves stage in place (a memory tier's), kept from one save to the next.
        self.files = StagingFiles()

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._cond:
            self._wait_for_place()
            fitting = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fitting:  # by position: list.remove would compare tensors with ==, element by element
                return self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
            if self._free:  # too small to reuse: give its memory back before allocating
                self._drop(self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel())))
            self._allocated += nbytes
        try:
            return self._allocate(nbytes)
        except BaseException:
            with self._cond:
                self._in_use -= 1
                self._allocated -= nbytes
                self._cond.notify_all()
            raise

    def hold_place(self) -> None:
        """Take one of the ``max_sets`` places for a save staged outside the pool's buffers (blocks
        while they are all in use); :meth:`free_place` gives it back."""
        with self._cond:
            self._wait_for_place()

    def free_place(self) -> None:
        with self._cond:
            self._in_use -= 1
            self._cond.notify_all()

    def _wait_for_place(self) -> None:  # under the lock
        # A buffer being registered is about to be free, and pinned: better than a fresh one.
        while self._in_use >= self.max_sets or self._registering:
            self._cond.wait()
        self._in_use += 1

    def release(self, buffer: torch.Tensor, *, copied_from: torch.device | None = None) -> None:
        """The buffer is free again. One that took copies from the accelerator device
        ``copied_from`` and was never page-locked is registered for it first, on a thread of the
        pool; a save that wants a buffer meanwhile waits for it."""
        with self._cond:
            self._in_use -= 1
            if copied_from is None or self.accelerator is None or id(buffer) in self._registered:
                self._free.append(buffer)
            else:
                registering = threading.Thread(target=self._register, args=(buffer, copied_from), name="bcp-pin",
                                               daemon=True)
                self._registering.append(registering)
                registering.start()
            self._cond.notify_all()

    def shared_of(self, buffer: torch.Tensor) -> SharedHostBuffer | None:
        """The shared memory behind one of this pool's buffers (None in a pool that is not shared)."""
        with self._cond:
            return self._shared.get(id(buffer))

    def shared_ids(self) -> set[int]:
        """The ids of the shared buffers the pool holds, in use or free."""
        with self._cond:
            return {shared.id for shared in self._shared.values()}

    def clear(self) -> None:
        """Give back the memory of the buffers not in use, and the staging files' (call it once no
        save is pending)."""
        with self._cond:
            while self._registering:
                self._cond.wait()
            while self._free:
                self._drop(self._free.pop())
        self.files.clear()

    @property
    def allocated_bytes(self) -> int:
        """Host memory held by the pool's buffers, in use or free."""
        with self._cond:
            return self._allocated

    @property
    def pinned_bytes(self) -> int:
        """Of that memory, the part page-locked by the accelerator (buffers that took its copies)."""
        with self._cond:
            return sum(nbytes for nbytes, _ in self._registered.values())

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if not self.shared:
            return torch.empty(nbytes, dtype=torch.uint8)
        shared = SharedHostBuffer(nbytes)
        with self._cond:
            self._shared[id(shared.tensor)] = shared
        return shared.tensor

    def _register(self, buffer: torch.Tensor, device: torch.device) -> None:
        try:
            registered = self.accelerator.register(buffer, device)
        except Exception as exc:  # noqa: BLE001 - the buffer stays pageable: later saves copy through chunks
            logger.warning("bcp: could not page-lock a %d-byte staging buffer (%r): asynchronous saves into it "
                           "copy through pinned chunks", buffer.numel(), exc)
            registered = False
        with self._cond:
            self._registered[id(buffer)] = (buffer.numel() if registered else 0, device)
            self._free.append(buffer)
            self._registering.remove(threading.current_thread())
            self._cond.notify_all()

    def _drop(self, buffer: torch.Tensor) -> None:  # under the lock
        self._allocated -= buffer.numel()
        nbytes, device = self._registered.pop(id(buffer), (0, None))
        if nbytes:
            self.accelerator.unregister(buffer, device)
        shared = self._shared.pop(id(buffer), None)
        if shared is not None:
            shared.close()


def stage(writes: list[PieceWrite], buffer: torch.Tensor, copies: ChunkedCopies) -> list[PieceWrite]:
    """Copy each write's tensor into ``buffer``; the returned writes read from the copies."""
    staged, pairs = place(writes, buffer)
    copy_in(pairs, copies)
    return staged


def place(writes: list[PieceWrite], buffer: torch.Tensor) -> tuple[list[PieceWrite], list[Pair]]:
    """Lay the writes out in ``buffer``: the writes reading from their places there, and the
    ``(place, tensor)`` pairs that :func:`copy_in` fills, in the writes' order."""
    staged, pairs, offset = [], [], 0
    for write in writes:
        t = write.tensor()
        view = buffer[offset: offset + write.nbytes].view(t.dtype).view(t.shape)
        pairs.append((view, t))
        staged.append(PieceWrite(write.index, write.part, view, write.nbytes, write.crcs))
        offset += _aligned(write.nbytes)
    return staged, pairs


def copy_in(pairs: Sequence[Pair], copies: ChunkedCopies) -> None:
    """Copy each pair's tensor into its place: host tensors here, device tensors through ``copies``."""
    from_device = []
    for view, t in pairs:
        if copies.holds(t):
            from_device.append((view, t))
        else:
            view.copy_(t)
    copies.to_host(from_device)
