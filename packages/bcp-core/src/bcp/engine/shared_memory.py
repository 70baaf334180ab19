"""Host buffers another process can map: anonymous shared memory (``memfd_create``), so the writer
process (``writer_process``) reads the staged bytes where the training process copied them, with no
copy between the two and no name in ``/dev/shm`` that a crash could leave behind: the memory goes
when the last process holding it closes it. And named files mapped shared (:class:`MappedFile`),
which a memory tier's saves stage into: the staged bytes are the file's (``staging_files``).

The staging pool (``staging``) has a buffer page-locked by the accelerator after its first use, and
unregisters it before closing it.
"""

from __future__ import annotations

import itertools
import os
import weakref

import torch

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
        self._closer = weakref.finalize(self, os.close, self.fd)  # a buffer dropped unclosed frees its fd
        os.ftruncate(self.fd, max(1, nbytes))
        # Mapped by torch, which keeps no descriptor of its own (Python's mmap would hold a duplicate
        # until its last view is collected); the mapping goes with the last tensor viewing it.
        self.tensor: torch.Tensor | None = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=nbytes,
                                                           dtype=torch.uint8)

    def close(self) -> None:
        """Give the memory back: unmapped here once no tensor views it, and there once the writer
        process has dropped its mapping too."""
        if self.fd < 0:
            return
        self.tensor = None
        self._closer()
        self.fd = -1


def mapped_files_available() -> bool:
    """Whether this platform allocates a file's blocks ahead (``posix_fallocate``), which
    :class:`MappedFile` needs (Linux)."""
    return hasattr(os, "posix_fallocate")


class MappedFile:
    """A named file of ``nbytes`` mapped shared (``tensor``, uint8): what is copied into the mapping
    is the file's content, with no write between the two. Its blocks are allocated when it is
    created (``posix_fallocate``), so that a full file system refuses it here with an ``OSError``
    instead of killing the process with SIGBUS when a copy first touches a page it cannot back.
    :meth:`resize` changes the size the file has within the mapping."""

    def __init__(self, path: str, nbytes: int) -> None:
        self.path = path
        self.capacity = max(1, nbytes)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._closer = weakref.finalize(self, os.close, self.fd)
        try:
            os.posix_fallocate(self.fd, 0, self.capacity)
            self.tensor: torch.Tensor | None = torch.from_file(path, shared=True, size=self.capacity,
                                                               dtype=torch.uint8)
        except BaseException:
            self.close()
            os.unlink(path)
            raise

    def resize(self, nbytes: int) -> None:
        """The file holds ``nbytes`` (at most its capacity), its blocks allocated."""
        if nbytes > self.capacity:
            raise ValueError(f"{self.path}: {nbytes} bytes do not fit a mapping of {self.capacity}")
        size = os.fstat(self.fd).st_size
        os.ftruncate(self.fd, nbytes)
        if nbytes > size:  # only the new part: allocating 384 MiB again took 15-34 ms on /dev/shm here
            os.posix_fallocate(self.fd, size, nbytes - size)

    def close(self) -> None:
        """Unmapped once no tensor views it; the file stays (unlink it to give its memory back)."""
        self.tensor = None
        self._closer()
