"""The dataloader component in one process: asynchronous saves, and the errors of wrong use."""

from __future__ import annotations

import pytest

import bcp
from dataloader_streams import loader


class Counter:
    """The smallest stateful loader: a position."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def test_an_async_save_keeps_the_state_of_the_call(tmp_path):
    mine = loader(0, 1)
    mine.next_batch()
    handle = bcp.save(tmp_path, {"dataloader": bcp.DataloaderState(mine, dp_rank=0, dp_size=1)}, async_save=True)
    expected = [mine.next_batch() for _ in range(3)]  # advances the buffers while the save is pending
    handle.wait()
    resumed = loader(0, 1)
    bcp.load(tmp_path, {"dataloader": bcp.DataloaderState(resumed, dp_rank=0, dp_size=1)})
    assert [resumed.next_batch() for _ in range(3)] == expected


def test_a_plain_stateful_object_round_trips(tmp_path):
    saved = Counter()
    saved.position = 17
    bcp.save(tmp_path, {"dataloader": bcp.DataloaderState(saved, dp_rank=0, dp_size=1)})
    restored = Counter()
    bcp.load(tmp_path, {"dataloader": bcp.DataloaderState(restored, dp_rank=0, dp_size=1)})
    assert restored.position == 17


def test_a_checkpoint_without_dataloader_state_is_refused(tmp_path):
    bcp.save(tmp_path, {"step": 3})
    with pytest.raises(bcp.MismatchError, match="holds no dataloader state"):
        bcp.load(tmp_path, {"step": 0, "dataloader": bcp.DataloaderState(loader(0, 1), dp_rank=0, dp_size=1)})


def test_a_loader_of_another_kind_is_refused(tmp_path):
    bcp.save(tmp_path, {"dataloader": bcp.DataloaderState(loader(0, 1), dp_rank=0, dp_size=1)})
    with pytest.raises(bcp.MismatchError, match="saved as 'sharded' state and the live loader is a Counter"):
        bcp.load(tmp_path, {"dataloader": bcp.DataloaderState(Counter(), dp_rank=0, dp_size=1)})


def test_wrong_use_is_reported(tmp_path):
    with pytest.raises(bcp.CheckpointError, match="0 <= dp_rank < dp_size, got 2 of 2"):
        bcp.DataloaderState(Counter(), dp_rank=2, dp_size=2)
    with pytest.raises(bcp.CheckpointError, match="neither a ShardedDataloader nor has state_dict"):
        bcp.DataloaderState(object(), dp_rank=0, dp_size=1)
    with pytest.raises(bcp.CheckpointError, match="belongs under the 'dataloader' key, not 'data'"):
        bcp.save(tmp_path, {"data": bcp.DataloaderState(Counter(), dp_rank=0, dp_size=1)})
