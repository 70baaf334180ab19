"""Host buffers another process can map: anonymous shared memory (``memfd_create``), so the writer
process (``writer_process``) reads the staged bytes where the training process copied them, with no
copy between the two and no name in ``/dev/shm`` that a crash could leave behind: the memory goes
when the last process holding it closes it.

Where an accelerator is present the buffer is also registered with the CUDA driver (page-locked),
as torch's own pinned memory is, so device-to-host copies into it run at the bus's speed.
"""

from __future__ import annotations

import itertools
import mmap
import os
import weakref

import torch

from bcp.engine.device_copies import register_pinned, unregister_pinned

_ids = itertools.count(1)


def shared_memory_available() -> bool:
    """Whether this platform can hand memory to another process by descriptor (Linux)."""
    return hasattr(os, "memfd_create")


class SharedHostBuffer:
    """``nbytes`` of shared memory: ``tensor`` (uint8) in this process, ``fd`` for another one;
    ``id`` names it to the writer process, which maps each buffer once."""

    def __init__(self, nbytes: int) -> None:
        self.id = next(_ids)
        self.nbytes = nbytes
        self.fd = os.memfd_create(f"bcp-staging-{self.id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(1, nbytes))
            self._map: mmap.mmap | None = mmap.mmap(self.fd, max(1, nbytes))
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        self.pinned = register_pinned(self.tensor)
        self._closer = weakref.finalize(self, os.close, self.fd)  # a buffer dropped unclosed frees its fd


    def close(self) -> None:
        """Give the memory back: it is unmapped once the last tensor viewing it is gone here, and
        once the writer process has dropped its mapping there."""
        if self.fd < 0:
            return
        if self.pinned:
            unregister_pinned(self.tensor)
        self.tensor = self._map = None  # the tensor holds the map: the last view to go unmaps it
        self._closer()
        self.fd = -1
