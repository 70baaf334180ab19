"""A sampler position across a DP change: the global order continues where it stopped."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

import bcp

SIZE, TAKEN, MORE = 50, 6, 4


def _sampler(rank: int, world: int) -> bcp.ResumableDistributedSampler:
    sampler = bcp.ResumableDistributedSampler(SIZE, dp_rank=rank, dp_size=world, seed=11)
    sampler.set_epoch(2)
    return sampler


def take_and_save(path: str, uneven: bool) -> list[int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = _sampler(rank, world)
    iterator = iter(sampler)
    taken = [next(iterator) for _ in range(TAKEN + (uneven and rank == 0))]
    bcp.save(path, {"dataloader": bcp.DataloaderState(sampler, dp_rank=rank, dp_size=world)})
    return taken


def resume(path: str) -> list[int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = _sampler(rank, world)
    sampler.set_epoch(0)  # the load brings back epoch 2 and the position
    bcp.load(path, {"dataloader": bcp.DataloaderState(sampler, dp_rank=rank, dp_size=world)})
    iterator = iter(sampler)
    return [next(iterator) for _ in range(MORE)]


def _interleaved(per_rank: list[list[int]]) -> list[int]:
    """The global order of lockstep ranks: step by step, rank by rank."""
    return [indices[step] for step in range(len(per_rank[0])) for indices in per_rank]


def test_the_order_is_distributed_samplers_without_padding():
    ours = [list(_sampler(r, 2)) for r in range(2)]
    theirs = []
    for r in range(2):
        sampler = DistributedSampler(range(SIZE), num_replicas=2, rank=r, shuffle=True, seed=11)
        sampler.set_epoch(2)
        theirs.append(list(sampler))
    assert ours == theirs


@pytest.mark.parametrize("dp_size", [2, 3])
def test_a_sampler_position_continues_the_global_order(ranks, tmp_path, dp_size):
    path = str(tmp_path / "ckpt")
    before = ranks(2).run(take_and_save, path, False)
    after = ranks(dp_size).run(resume, path)
    order = _sampler(0, 1).order()
    assert _interleaved(before) + _interleaved(after) == order[:2 * TAKEN + dp_size * MORE]


def test_uneven_positions_are_refused_on_another_dp_size(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks(2).run(take_and_save, path, True)
    with pytest.raises(bcp.MismatchError, match=r"different numbers of samples \(\[7, 6\]\)"):
        bcp.load(path, {"dataloader": bcp.DataloaderState(_sampler(0, 1), dp_rank=0, dp_size=1)})
