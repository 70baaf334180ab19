"""I/O lanes: how the reader's worker threads share the batches, and each worker's scratch memory.

A few worker threads take batches from per-file lanes: each worker streams through a file of its
own, in file order, as a raw parallel read of the files would, and helps with the fullest lane once
its own is empty.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from bcp.engine.read_segments import Segment

# Scratch slots start on cache lines, so any dtype can view them.
_SLOT_ALIGN = 64


class Lanes:
    """Batches grouped by file, each group in file order. Worker ``i`` starts on the ``i``-th file
    (modulo their number) and keeps to its lane; an empty lane sends it to the one with the most
    bytes left. Streaming whole files per worker measured about 10% faster on cold reads here than
    all workers sharing one file-ordered list (which puts them side by side in one file)."""

    def __init__(self, batches: list[list[Segment]]) -> None:
        by_file: dict[int, deque[list[Segment]]] = {}
        for batch in batches:
            by_file.setdefault(batch[0].where.file, deque()).append(batch)
        self._lanes = list(by_file.values())
        self._left = [sum(s.nbytes for batch in lane for s in batch) for lane in self._lanes]
        self._lock = threading.Lock()

    def take(self, lane: int) -> tuple[list[Segment], int] | None:
        """The next batch for a worker on ``lane`` and the lane it came from; None when all are done."""
        with self._lock:
            lane %= len(self._lanes)
            if not self._lanes[lane]:
                lane = max(range(len(self._lanes)), key=self._left.__getitem__)
                if not self._lanes[lane]:
                    return None
            batch = self._lanes[lane].popleft()
            self._left[lane] -= sum(s.nbytes for s in batch)
            return batch, lane


class Scratch:
    """A worker's reusable scratch memory: a batch's scratch segments get consecutive slots."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._decoded = torch.empty(0, dtype=torch.uint8)

    def decoded(self, nbytes: int) -> torch.Tensor:
        """Memory for ``nbytes`` of decoded chunks (apart from the slots, which hold their stored bytes)."""
        if nbytes > self._decoded.numel():
            self._decoded = torch.empty(nbytes, dtype=torch.uint8)
        return self._decoded[:nbytes]

    def slots(self, batch: list[Segment]) -> list[torch.Tensor | None]:
        sizes = [-(-s.nbytes // _SLOT_ALIGN) * _SLOT_ALIGN if s.dests is None else 0 for s in batch]
        if sum(sizes) > self.buffer.numel():
            self.buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        slots: list[torch.Tensor | None] = []
        at = 0
        for segment, size in zip(batch, sizes):
            slots.append(self.buffer[at: at + segment.nbytes] if segment.dests is None else None)
            at += size
        return slots
