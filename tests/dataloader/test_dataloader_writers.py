"""A save whose DP groups do not each declare exactly one writer of their dataloader parts fails on
every rank with an error naming the DP index, before any of the checkpoint's data is written."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

import bcp
from bcp.engine.location import METRICS_DIR
from dataloader_streams import loader


def save_with_writers(path: str, dp_size: int, writers: list[bool]) -> str:
    """Ranks ``rank // (world // dp_size)`` of each DP group; rank r passes ``writer=writers[r]``.
    Returns the error each rank raised."""
    rank = dist.get_rank()
    dp_rank = rank * dp_size // dist.get_world_size()
    state = {"dataloader": bcp.DataloaderState(loader(dp_rank, dp_size), dp_rank=dp_rank, dp_size=dp_size,
                                               writer=writers[rank]),
             "extra_state": {"rank": rank}}
    with pytest.raises(bcp.CheckpointError) as caught:
        bcp.save(path, state)
    return str(caught.value)


def _written_files(path: str) -> list[str]:
    """Every file under the checkpoint except the generations' claims."""
    return sorted(os.path.relpath(os.path.join(folder, name), path) for folder, _, names in os.walk(path)
                  for name in names if name != "CLAIM" and METRICS_DIR not in folder)


@pytest.mark.parametrize("dp_size, writers, expected", [
    (2, [True, False], "DP index 1 of 2: no rank is declared the writer"),
    (1, [True, True], "DP index 0 of 1: ranks [0, 1] are all declared the writer"),
    (1, [False, False], "DP index 0 of 1: no rank is declared the writer"),
])
def test_a_dp_group_without_exactly_one_writer_fails_before_writing(ranks, tmp_path, dp_size, writers, expected):
    path = str(tmp_path / "ckpt")
    errors = ranks(2).run(save_with_writers, path, dp_size, writers)
    assert all(expected in error and path in error for error in errors), errors
    assert _written_files(path) == []


def test_ranks_that_disagree_on_the_dp_size_fail(tmp_path):
    from bcp.adapters.dataloader import check_writers
    with pytest.raises(bcp.CheckpointError, match=r"disagree on the DP size: \[1, 2\]"):
        check_writers([[0, 2, 1], [0, 1, 1]])
    check_writers([[0, 2, 1], [1, 2, 1], None])  # a rank without dataloader state is not counted
