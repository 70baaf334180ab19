"""I/O lanes: how the reader's worker threads share the batches, each worker's scratch memory, and
the helper that finishes a worker's batch while it reads the next.

A few worker threads take batches from per-file lanes: each worker streams through a file of its
own, in file order, as a raw parallel read of the files would, and helps with the fullest lane once
its own is empty.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from bcp.engine.bytes_of import byte_view
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

    def stored(self, nbytes: int) -> memoryview:
        """Memory for ``nbytes`` of stored bytes read in one piece (the slots' memory: a batch read so
        has no slots)."""
        if nbytes > self.buffer.numel():
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return byte_view(self.buffer[:nbytes])

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


class Overlapped:
    """Steps run one after another on a helper thread, overlapping the caller's work, in groups (a
    batch's steps): ``then`` waits for every step before (raising the first one's error) and starts
    a group of one step; ``begin`` starts a group once those before the last one are done (a worker's
    two scratch memories alternate between groups); ``add`` queues a step in the current group
    without waiting; ``wait`` waits for them all. Leaving the block waits for steps still queued, so
    none outlives the caller's work."""

    def __init__(self) -> None:
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcp-read-finish")
        self._groups: list[list[Future]] = []

    def then(self, step: Callable[[], None]) -> None:
        self.wait()
        self.begin()
        self.add(step)

    def begin(self) -> None:
        while len(self._groups) > 1:
            for step in self._groups.pop(0):
                step.result()
        self._groups.append([])

    def add(self, step: Callable[[], None]) -> None:
        self._groups[-1].append(self._helper.submit(step))

    def wait(self) -> None:
        groups, self._groups = self._groups, []
        for group in groups:
            for step in group:
                step.result()

    def __enter__(self) -> "Overlapped":
        return self

    def __exit__(self, *exc: object) -> None:
        self._helper.shutdown(wait=True)
