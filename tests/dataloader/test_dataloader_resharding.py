"""Dataloader state across DP and TP changes: train on DP=2, save, resume on other layouts; every
sequence and token is delivered exactly once overall, in the same order when the DP size is kept."""

from __future__ import annotations

from collections import Counter

import pytest
import torch.distributed as dist

import bcp
from bcp.api.checkpoint import open_checkpoint
from dataloader_streams import loader, uninterrupted

BEFORE, AFTER = 5, 9  # steps before the save, steps after the resume


def train_and_save(path: str, tp: int) -> list[list[list[int]]]:
    """Every rank: DP index ``rank // tp`` of ``world // tp``; the TP rank 0 of each DP group writes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = rank // tp, world // tp
    mine = loader(dp_rank, dp_size)
    consumed = [mine.next_batch() for _ in range(BEFORE)]
    bcp.save(path, {"dataloader": bcp.DataloaderState(mine, dp_rank=dp_rank, dp_size=dp_size, writer=rank % tp == 0)})
    return consumed


def resume(path: str) -> list[list[list[int]]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = loader(rank, world)  # a fresh start's streams, replaced by the load
    bcp.load(path, {"dataloader": bcp.DataloaderState(mine, dp_rank=rank, dp_size=world)})
    return [mine.next_batch() for _ in range(AFTER)]


def _sequences(per_rank: list[list[list[list[int]]]]) -> Counter:
    return Counter(tuple(seq) for batches in per_rank for batch in batches for seq in batch)


def _tokens(per_rank: list[list[list[list[int]]]]) -> Counter:
    return Counter(token for batches in per_rank for batch in batches for seq in batch for token in seq)


@pytest.fixture(scope="module")
def saved_on_dp2(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dp2") / "ckpt")
    return path, ranks(2).run(train_and_save, path, 1)


@pytest.mark.parametrize("dp_size", [2, 1, 3, 4])
def test_resume_on_another_dp_size_delivers_every_sequence_once(ranks, saved_on_dp2, dp_size):
    path, before = saved_on_dp2
    after = ranks(dp_size).run(resume, path)
    expected = uninterrupted(2, BEFORE + AFTER)
    assert before == [batches[:BEFORE] for batches in expected]
    assert _sequences(before) + _sequences(after) == _sequences(expected)
    assert _tokens(before) + _tokens(after) == _tokens(expected)
    assert sum(len(batch) for batches in after for batch in batches) == 4 * AFTER  # the global batch is kept
    if dp_size == 2:
        assert after == [batches[BEFORE:] for batches in expected]  # same order, rank by rank


def test_a_tp_change_gives_every_dp_index_its_own_buffers(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    before = ranks(4).run(train_and_save, path, 2)  # TP2 x DP2: ranks 0, 1 are DP 0; ranks 2, 3 DP 1
    assert before[0] == before[1] and before[2] == before[3]
    checkpoint = open_checkpoint(path)
    writers = {name: [r for r, record in enumerate(entry.ranks) if record >= 0]
               for name, entry in checkpoint.objects.items()}
    assert writers == {"dataloader/replicated": [0],
                       "dataloader/shard/dp0-of-2/worker0-of-2": [0], "dataloader/shard/dp0-of-2/worker1-of-2": [0],
                       "dataloader/shard/dp1-of-2/worker0-of-2": [2], "dataloader/shard/dp1-of-2/worker1-of-2": [2]}
    after = ranks(2).run(resume, path)  # now DP2 without TP
    expected = uninterrupted(2, BEFORE + AFTER)
    assert after == [batches[BEFORE:] for batches in expected]
