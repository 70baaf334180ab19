"""Loaders with read-worker processes (2 workers, default prefetch) in a bare ``bcp.DataloaderState``,
resumed on any number of ranks: a torch DataLoader and a torchdata StatefulDataLoader with
bcp.ResumableDistributedSampler, a StatefulDataLoader with torch's DistributedSampler shuffled and in
order, and a torch DataLoader whose bcp sampler is saved on its own (the bare sampler in the entry).

2 gloo ranks run three epochs uninterrupted, saving after 5 batches of epoch 0 (40 samples: no whole
number of batches on 3 ranks), after its last batch and after 5 batches of epoch 2. Resumed on 2,
each rank takes the very batches of the uninterrupted run, and the epoch after a save at the end of
one is the uninterrupted run's next epoch; on 1, 3 and 4 ranks the samples before the save and after
it are every sample of the epoch exactly once (in epoch 2 too). The same from 4 ranks to 3 and from
3 to 2.

The defects this guards: the sampler counted the indices handed to the workers, which prefetch
``num_workers x prefetch_factor`` batches ahead, so a resume skipped the samples read ahead; torch's
DistributedSampler resumed on another DP size only where the consumed samples made a whole number
of batches per new rank, and was refused otherwise."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import bcp
import spawned_ranks
from resumed_epochs import BATCH, BEFORE, SIZE, assert_continues, assert_rest_once, chained_runs

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

WORKERS = 2
KINDS = ("DataLoader+bcp sampler", "StatefulDataLoader+bcp sampler", "StatefulDataLoader+DistributedSampler",
         "StatefulDataLoader+DistributedSampler, in order", "DataLoader+bcp sampler, the bare sampler in the entry")


class Ids(Dataset):
    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> int:
        return i


def _loader(kind: str, rank: int, world: int) -> DataLoader:
    shuffle = not kind.endswith("in order")
    if "bcp sampler" in kind:
        sampler = bcp.ResumableDistributedSampler(SIZE, dp_rank=rank, dp_size=world, shuffle=shuffle, seed=7)
    else:
        sampler = DistributedSampler(Ids(), num_replicas=world, rank=rank, shuffle=shuffle, seed=7)
    cls = DataLoader if kind.startswith("DataLoader") else stateful_dataloader.StatefulDataLoader
    return cls(Ids(), batch_size=BATCH, sampler=sampler, num_workers=WORKERS)


def _entry(loader: DataLoader, rank: int, world: int, kind: str = "") -> dict:
    saved = loader.sampler if kind.endswith("the bare sampler in the entry") else loader
    return {"dataloader": bcp.DataloaderState(saved, dp_rank=rank, dp_size=world)}


def run_epochs(folder: str, epochs: int = 3, saves: tuple = ((0, BEFORE),), resume_from: str | None = None,
               first_epoch: int = 0) -> dict[str, dict[int, list[int]]]:
    """Per loader kind, the samples each epoch delivered to this rank from ``first_epoch`` on (after
    loading ``<resume_from>/<kind>``), saving ``<folder>/e<epoch>b<batches>/<kind>`` after the batches named."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, dict[int, list[int]]] = {}
    for kind in KINDS:
        loader = _loader(kind, rank, world)
        state = _entry(loader, rank, world, kind)  # built before iterating: a plain DataLoader's iterator is followed
        if resume_from is not None:
            bcp.load(os.path.join(resume_from, kind), state)
        for epoch in range(first_epoch, epochs):
            loader.sampler.set_epoch(epoch)  # as a training loop does; the resumed epoch keeps its position
            out.setdefault(kind, {})[epoch] = seen = []
            for count, batch in enumerate(loader, 1):
                seen += batch.tolist()
                if (epoch, count) in saves:
                    bcp.save(os.path.join(folder, f"e{epoch}b{count}", kind), state)
    return out


runs = chained_runs(run_epochs)


def test_a_resume_on_the_same_dp_size_continues_with_the_uninterrupted_batches(runs):
    assert_continues(runs, KINDS)


@pytest.mark.parametrize("dp_size", [1, 3, 4])
def test_every_sample_exactly_once_after_a_resume_on_another_dp_size(runs, dp_size):
    assert_rest_once(runs, "uninterrupted", f"2 -> {dp_size}", KINDS)
    if dp_size == 3:
        assert_rest_once(runs, "uninterrupted", "2 -> 3 in epoch 2", KINDS, epoch=2)


@pytest.mark.parametrize("saved_on, resumed_on", [(4, 3), (3, 2)])
def test_every_sample_exactly_once_from_more_ranks_to_fewer(runs, saved_on, resumed_on):
    assert_rest_once(runs, f"saved on {saved_on}", f"{saved_on} -> {resumed_on}", KINDS)


def test_ranks_that_consumed_different_numbers_of_batches_resume_only_on_their_own_number(tmp_path):
    """Rank 1 one batch ahead of rank 0: what they consumed is no prefix of the order, so it cannot be
    dealt to another number of ranks (refused, naming the counts)."""
    kind = "StatefulDataLoader+DistributedSampler"
    path = str(tmp_path / "ckpt")
    spawned_ranks.run(2, save_after, path, kind)
    with pytest.raises(bcp.MismatchError, match=r"the saved ranks had consumed \[16, 20\] of their shares"):
        bcp.load(path, _entry(_loader(kind, 0, 3), 0, 3))


def save_after(path: str, kind: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = _loader(kind, rank, world)
    taken = iter(loader)
    for _ in range(BEFORE - 1 + rank):
        next(taken)
    bcp.save(path, _entry(loader, rank, world))


def test_a_torch_dataloader_with_a_distributed_sampler_is_refused():
    """torch's DataLoader does not say how far its DistributedSampler got, nor can it start the
    sampler mid-epoch: refused when the state is built, not saved as the epoch's start."""
    loader = DataLoader(Ids(), batch_size=BATCH, sampler=DistributedSampler(Ids(), num_replicas=1, rank=0))
    with pytest.raises(bcp.CheckpointError, match="a torch DataLoader with torch's DistributedSampler keeps no position"):
        _entry(loader, 0, 1)
