"""Loaders with read-worker processes (2 workers, default prefetch) save what the trainer consumed,
not what their workers read ahead: a torch DataLoader and a torchdata StatefulDataLoader with
bcp.ResumableDistributedSampler, a StatefulDataLoader with torch's DistributedSampler, and a torch
DataLoader whose bcp sampler is saved on its own (the bare sampler in the entry), each shuffled,
consume 6 batches per rank on 2 gloo ranks and save; resumed on 2, 1, 3 or 4 ranks, the samples
before the save and after it are every sample exactly once, and on 2 ranks each rank continues
with the very batches of the uninterrupted run.

The defect this guards: the sampler counted the indices handed to the workers, which prefetch
``num_workers x prefetch_factor`` batches ahead, so a resume skipped the samples read ahead (saved
on its own, the sampler went on doing so after the loader in the entry was fixed)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import bcp
import spawned_ranks

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

SIZE, BATCH, WORKERS, EPOCH = 96, 4, 2, 1
CONSUMED = 6  # batches per rank before the save: 48 samples, a whole number of batches on 1, 2, 3 and 4 ranks
KINDS = ("DataLoader+bcp sampler", "StatefulDataLoader+bcp sampler", "StatefulDataLoader+DistributedSampler",
         "DataLoader+bcp sampler, the bare sampler in the entry")


class Ids(Dataset):
    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> int:
        return i


def _loader(kind: str, rank: int, world: int, epoch: int = EPOCH) -> DataLoader:
    if "bcp sampler" in kind:
        sampler = bcp.ResumableDistributedSampler(SIZE, dp_rank=rank, dp_size=world, shuffle=True, seed=7)
    else:
        sampler = DistributedSampler(Ids(), num_replicas=world, rank=rank, shuffle=True, seed=7)
    sampler.set_epoch(epoch)
    cls = DataLoader if kind.startswith("DataLoader") else stateful_dataloader.StatefulDataLoader
    return cls(Ids(), batch_size=BATCH, sampler=sampler, num_workers=WORKERS)


def _entry(loader: DataLoader, rank: int, world: int, kind: str = "") -> dict:
    saved = loader.sampler if kind.endswith("the bare sampler in the entry") else loader
    return {"dataloader": bcp.DataloaderState(saved, dp_rank=rank, dp_size=world)}


def save_mid_epoch(folder: str) -> dict[str, tuple[list[int], list[int]]]:
    """Per loader kind: the samples before the save, and those the uninterrupted run takes after it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in KINDS:
        loader = _loader(kind, rank, world)
        state = _entry(loader, rank, world, kind)  # built before iterating: a plain DataLoader's iterator is followed
        batches = iter(loader)
        before = [i for _ in range(CONSUMED) for i in next(batches).tolist()]
        bcp.save(f"{folder}/{kind}", state)
        out[kind] = (before, [i for batch in batches for i in batch.tolist()])
    return out


def resume(folder: str) -> dict[str, list[int]]:
    """Per loader kind: the samples a loader built for epoch 0 delivers after the load (the load
    brings back the epoch and the position), to the end of the epoch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in KINDS:
        loader = _loader(kind, rank, world, epoch=0)
        bcp.load(f"{folder}/{kind}", _entry(loader, rank, world, kind))
        out[kind] = [i for batch in loader for i in batch.tolist()]
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("workers"))
    return folder, spawned_ranks.run(2, save_mid_epoch, folder)


@pytest.mark.parametrize("dp_size", [2, 1, 3, 4])
def test_every_sample_exactly_once_after_a_resume_on_any_dp_size(saved, dp_size):
    folder, before_and_after = saved
    resumed = spawned_ranks.run(dp_size, resume, folder)
    for kind in KINDS:
        before = [i for rank in before_and_after for i in rank[kind][0]]
        assert len(before) == 2 * CONSUMED * BATCH
        after = [i for rank in resumed for i in rank[kind]]
        assert sorted(before + after) == list(range(SIZE)), kind
        if dp_size == 2:
            assert [rank[kind] for rank in resumed] == [rank[kind][1] for rank in before_and_after], kind


def test_a_distributed_sampler_position_off_a_whole_batch_is_refused(tmp_path):
    """5 batches of 4 on 2 ranks are 40 samples: 13.3 per rank on 3 ranks, 10 (2.5 batches) on 4,
    where torch's DistributedSampler cannot start; bcp's sampler can."""
    kind = "StatefulDataLoader+DistributedSampler"
    path = str(tmp_path / "ckpt")
    spawned_ranks.run(2, save_after, path, kind, 5)
    for dp_size in (3, 4):
        with pytest.raises(bcp.MismatchError, match=f"consumed 40 samples of the epoch; a DistributedSampler on "
                                                    f"{dp_size} ranks can only resume at a whole number of batches"):
            bcp.load(path, _entry(_loader(kind, 0, dp_size), 0, dp_size))


def save_after(path: str, kind: str, batches: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = _loader(kind, rank, world)
    taken = iter(loader)
    for _ in range(batches):
        next(taken)
    bcp.save(path, _entry(loader, rank, world))


def test_a_torch_dataloader_with_a_distributed_sampler_is_refused():
    """torch's DataLoader does not say how far its DistributedSampler got, nor can it start the
    sampler mid-epoch: refused when the state is built, not saved as the epoch's start."""
    loader = DataLoader(Ids(), batch_size=BATCH, sampler=DistributedSampler(Ids(), num_replicas=1, rank=0))
    with pytest.raises(bcp.CheckpointError, match="a torch DataLoader with torch's DistributedSampler keeps no position"):
        _entry(loader, 0, 1)
