"""Prefetching (paper section 4.5): with the checkpoint interval known, the token stream loader's
read workers build the state of a checkpoint step one step ahead, so collecting it asks nothing of
them. The prefetched state is exactly the state at the checkpoint step: it equals the state asked
of the workers, and a run resumed from it continues exactly as an uninterrupted run."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

import bcp
from dataloader_streams import loader, uninterrupted

EVERY, BEFORE, AFTER = 3, 6, 7  # checkpoint interval, steps before the save, steps after the resume


def _plain(states: list[dict]) -> list[dict]:
    """States with buffers as lists, compared exactly."""
    return [{**state, "buffer": state["buffer"].tolist()} for state in states]


def test_prefetched_states_equal_the_states_asked_of_the_workers():
    prefetching, asking = loader(1, 2), loader(1, 2)
    prefetching.plan_checkpoints(EVERY)
    for step in range(1, 3 * EVERY + 1):
        assert prefetching.next_batch() == asking.next_batch()
        if step % EVERY == 0:
            assert _plain(prefetching.sharded_states()) == _plain(asking.sharded_states())
            assert all(state["buffer"].dtype == torch.int64 for state in prefetching.sharded_states())
    assert (prefetching.state_round_trips, asking.state_round_trips) == (0, 3)


def test_between_checkpoints_the_state_is_asked_and_still_exact():
    prefetching, asking = loader(0, 1), loader(0, 1)
    prefetching.plan_checkpoints(EVERY)
    for _ in range(EVERY + 1):
        assert prefetching.next_batch() == asking.next_batch()
    assert _plain(prefetching.sharded_states()) == _plain(asking.sharded_states())
    assert prefetching.state_round_trips == 1
    assert prefetching.next_batch() == asking.next_batch()  # the read-ahead survived the round trip


def test_a_loader_without_prefetching_is_refused_an_interval():
    class Position:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None: ...

    with pytest.raises(bcp.CheckpointError, match="cannot prefetch its state"):
        bcp.DataloaderState(Position(), dp_rank=0, dp_size=1, checkpoint_every=2)


def train_prefetching_and_save(path: str) -> tuple[list, int]:
    """DP rank = rank of 2: BEFORE steps with the interval planned, save at the checkpoint step."""
    rank = dist.get_rank()
    mine = loader(rank, 2)
    state = {"dataloader": bcp.DataloaderState(mine, dp_rank=rank, dp_size=2, checkpoint_every=EVERY)}
    consumed = [mine.next_batch() for _ in range(BEFORE)]
    bcp.save(path, state)
    return consumed, mine.state_round_trips


def resume(path: str) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = loader(rank, world)
    bcp.load(path, {"dataloader": bcp.DataloaderState(mine, dp_rank=rank, dp_size=world)})
    return [mine.next_batch() for _ in range(AFTER)]


def _sequences(per_rank: list) -> Counter:
    return Counter(tuple(seq) for batches in per_rank for batch in batches for seq in batch)


@pytest.fixture(scope="module")
def saved_prefetched(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("prefetch") / "ckpt")
    results = ranks(2).run(train_prefetching_and_save, path)
    assert [trips for _, trips in results] == [0, 0]  # the save collected prefetched states only
    return path, [consumed for consumed, _ in results]


def test_a_run_resumed_from_a_prefetched_state_continues_in_the_same_order(ranks, saved_prefetched):
    path, before = saved_prefetched
    expected = uninterrupted(2, BEFORE + AFTER)
    assert before == [batches[:BEFORE] for batches in expected]
    assert ranks(2).run(resume, path) == [batches[BEFORE:] for batches in expected]


def test_a_run_resumed_from_a_prefetched_state_on_dp3_delivers_every_sequence_once(ranks, saved_prefetched):
    path, before = saved_prefetched
    after = ranks(3).run(resume, path)
    assert _sequences(before) + _sequences(after) == _sequences(uninterrupted(2, BEFORE + AFTER))
