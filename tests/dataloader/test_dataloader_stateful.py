"""torchdata's StatefulDataLoader over an iterable dataset whose read workers keep their own state
(2 workers per rank): its ``state_dict`` is saved per DP index and resumed mid-epoch on the same DP
size with identical batches; a DP change is refused, saying why (the workers' positions lie within
the old ranks' shards of the stream and bcp cannot split or merge them)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import bcp
import spawned_ranks

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

WORLD, BEFORE, AFTER, WORKERS = 2, 3, 4, 2


class Counting(torch.utils.data.IterableDataset):
    """Numbers ``k`` with ``k % (ranks x workers)`` equal to this worker's slot; the next one is its state."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.next = rank, world, None

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        slots, slot = self.world * info.num_workers, self.rank * info.num_workers + info.id
        if self.next is None:
            self.next = slot
        while self.next < 200:
            value, self.next = self.next, self.next + slots
            yield value

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = state["next"]


def _loader(rank: int, world: int) -> "stateful_dataloader.StatefulDataLoader":
    return stateful_dataloader.StatefulDataLoader(Counting(rank, world), batch_size=3, num_workers=WORKERS)


def _batches(iterator, n: int) -> list:
    return [next(iterator).tolist() for _ in range(n)]


def save_mid_epoch(path: str) -> list:
    rank = dist.get_rank()
    loader = _loader(rank, WORLD)
    iterator = iter(loader)
    _batches(iterator, BEFORE)
    bcp.save(path, {"dataloader": bcp.DataloaderState(loader, dp_rank=rank, dp_size=WORLD)})
    return _batches(iterator, AFTER)


def resume(path: str) -> list:
    rank = dist.get_rank()
    loader = _loader(rank, WORLD)
    bcp.load(path, {"dataloader": bcp.DataloaderState(loader, dp_rank=rank, dp_size=WORLD)})
    return _batches(iter(loader), AFTER)


def test_stateful_dataloader_resumes_mid_epoch_with_identical_batches(tmp_path):
    path = str(tmp_path / "ckpt")
    expected = spawned_ranks.run(WORLD, save_mid_epoch, path)
    assert spawned_ranks.run(WORLD, resume, path) == expected
    assert expected[0] != expected[1]  # each DP index got its own position back, not rank 0's
    with pytest.raises(bcp.MismatchError, match="saved on 2 DP ranks and is loaded on 1: .*iterable dataset"):
        bcp.load(path, {"dataloader": bcp.DataloaderState(_loader(0, 1), dp_rank=0, dp_size=1)})
