"""A disk that fills up during a save: the save fails with a ``CheckpointError``,
the previous checkpoint still loads, and what the failed save wrote is removed, so the next
(smaller) save succeeds. The full disk is a storage with a capacity (every file under its root
counts); a test cannot fill this machine's disk for real.

Guards a past defect: the failed save's partial generation stayed behind, so the next (smaller) save
failed too until someone cleaned up by hand."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator

import pytest
import torch

import bcp
from bcp.storage import LocalStorage

KIB = 1024


class SmallDisk(LocalStorage):
    """Local files under ``root`` on a disk of ``capacity`` bytes: a write that would go beyond it
    fails part way with ``ENOSPC``, as a full disk does."""

    def __init__(self, root: str | os.PathLike, capacity: int) -> None:
        super().__init__(root)
        self.capacity = capacity

    def used(self) -> int:
        return sum(os.path.getsize(os.path.join(folder, name))
                   for folder, _, names in os.walk(self.root) for name in names)

    def write_file(self, name: str, chunks: Iterable[memoryview]) -> None:
        super().write_file(name, self._until_full(chunks))

    def _until_full(self, chunks: Iterable[memoryview]) -> Iterator[memoryview]:
        free = self.capacity - self.used()
        for chunk in chunks:
            chunk = chunk.cast("B")
            if chunk.nbytes > free:
                yield chunk[:max(free, 0)]  # what still fits is written, then the disk is full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            free -= chunk.nbytes
            yield chunk


def _state(nbytes: int, seed: int) -> dict:
    return {"model": {"w": torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed))}}


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_that_fills_the_disk_leaves_room_for_the_next(tmp_path, async_save):
    disk = SmallDisk(tmp_path / "ckpt", capacity=2560 * KIB)
    first = _state(100 * KIB, seed=1)
    bcp.save(disk, first)

    with pytest.raises(bcp.CheckpointError, match="No space left on device"):
        bcp.save(disk, _state(8192 * KIB, seed=2), async_save=async_save).wait()  # 2.4 MiB get written

    out = _state(100 * KIB, seed=0)
    assert bcp.load(disk, out).generation == 1  # the previous checkpoint is intact
    assert torch.equal(out["model"]["w"], first["model"]["w"])
    assert disk.used() < 120 * KIB, "the failed save left what it wrote behind"

    third = _state(100 * KIB, seed=3)
    assert bcp.save(disk, third).generation == 2  # the failed generation was removed whole: its number is free
    assert bcp.load(disk, out).generation == 2
    assert torch.equal(out["model"]["w"], third["model"]["w"])


def test_a_save_whose_metadata_does_not_fit_removes_its_data_files(tmp_path):
    disk = SmallDisk(tmp_path / "ckpt", capacity=0)
    bcp.save(LocalStorage(disk.root), _state(100 * KIB, seed=1))
    disk.capacity = disk.used() + 2048 * KIB + 300  # the claim, the data and the shard table fit; the manifest not
    with pytest.raises(bcp.CheckpointError, match="No space left on device"):
        bcp.save(disk, _state(2048 * KIB, seed=2))
    assert disk.used() < 120 * KIB, "the failed save left its data files behind"
    assert bcp.save(disk, _state(100 * KIB, seed=3)).generation == 2  # the failed one was removed whole
