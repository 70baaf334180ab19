"""A StatefulDataLoader (2 read workers, default prefetch) over an iterable dataset implementing
bcp.ReshardableIterableDataset: 96 ids cut into 12 shards, each (DP rank, worker) slot reading the
shards ``s`` with ``s % slots == slot``. 2 gloo ranks take 5 batches of 3 each and save; resumed on
2, 1, 3 or 4 ranks, the ids before the save and after it are every id exactly once (on 2 ranks,
the very batches of the uninterrupted run). The defect this guards: another DP size was refused
for every iterable dataset, having no way to move its workers' positions."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import bcp
import spawned_ranks

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

SIZE, SHARDS, BATCH, WORKERS, BEFORE = 96, 12, 3, 2, 5


class ShardedIds(torch.utils.data.IterableDataset):
    """Ids ``i`` in shard ``i % SHARDS``; a slot reads its shards in turn, one id each."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.positions = {str(s): 0 for s in range(SHARDS)}  # ids taken from each shard

    def _mine(self) -> list[str]:
        info = torch.utils.data.get_worker_info()
        slots, slot = self.world * info.num_workers, self.rank * info.num_workers + info.id
        return [str(s) for s in range(SHARDS) if s % slots == slot]

    def __iter__(self):
        mine = self._mine()
        while True:
            live = [s for s in mine if int(s) + self.positions[s] * SHARDS < SIZE]
            if not live:
                return
            for shard in live:
                value = int(shard) + self.positions[shard] * SHARDS
                self.positions[shard] += 1
                yield value

    def state_dict(self) -> dict:
        return {"shards": {s: self.positions[s] for s in self._mine()}}

    def load_state_dict(self, state: dict) -> None:
        self.positions.update(state["shards"])

    def load_shard_positions(self, positions: dict) -> None:
        self.positions = dict(positions)


def _loader(rank: int, world: int):
    return stateful_dataloader.StatefulDataLoader(ShardedIds(rank, world), batch_size=BATCH, num_workers=WORKERS)


def _entry(loader, rank: int, world: int) -> dict:
    return {"dataloader": bcp.DataloaderState(loader, dp_rank=rank, dp_size=world)}


def save_mid_epoch(path: str) -> tuple[list[int], list[int]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = _loader(rank, world)
    batches = iter(loader)
    before = [i for _ in range(BEFORE) for i in next(batches).tolist()]
    bcp.save(path, _entry(loader, rank, world))
    return before, [i for batch in batches for i in batch.tolist()]


def resume(path: str) -> list[int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = _loader(rank, world)
    bcp.load(path, _entry(loader, rank, world))
    return [i for batch in loader for i in batch.tolist()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("iterable-shards") / "ckpt")
    return path, spawned_ranks.run(2, save_mid_epoch, path)


@pytest.mark.parametrize("dp_size", [2, 1, 3, 4])
def test_every_id_exactly_once_after_a_resume_on_any_dp_size(saved, dp_size):
    path, before_and_after = saved
    resumed = spawned_ranks.run(dp_size, resume, path)
    before = [i for rank in before_and_after for i in rank[0]]
    assert len(before) == 2 * BEFORE * BATCH
    after = [i for rank in resumed for i in rank]
    assert sorted(before + after) == list(range(SIZE))
    if dp_size == 2:
        assert resumed == [rank[1] for rank in before_and_after]
