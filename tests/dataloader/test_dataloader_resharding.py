"""Dataloader state across DP and TP changes: train on DP=2, save, resume on other layouts; every
sequence and token is delivered exactly once overall, in the same order when the DP size is kept."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter

import pytest
import torch.distributed as dist

import bcp
from bcp.api.checkpoint import open_checkpoint
from bcp.engine.location import generation_dir
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


# The checks below read the DP=2 checkpoint in this process, as DP rank 1 of 2.
DP1_PART = "dataloader/shard/dp1-of-2/worker1-of-2"


def _load_as_dp1(path: str) -> bcp.TokenStreamLoader:
    mine = loader(1, 2)
    bcp.load(path, {"dataloader": bcp.DataloaderState(mine, dp_rank=1, dp_size=2)})
    return mine


def test_one_process_restores_any_dp_index(saved_on_dp2):
    path, _ = saved_on_dp2
    mine = _load_as_dp1(path)
    assert [mine.next_batch() for _ in range(AFTER)] == uninterrupted(2, BEFORE + AFTER)[1][BEFORE:]


def test_a_corrupt_part_is_named_with_its_dp_index(saved_on_dp2, tmp_path):
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved_on_dp2[0], path)
    checkpoint = open_checkpoint(path)
    where, _ = checkpoint.objects[DP1_PART].records[0]
    data = os.path.join(path, generation_dir(checkpoint.generation), checkpoint.manifest.files[where.file])
    with open(data, "r+b") as f:
        f.seek(where.offset + where.nbytes - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(bcp.CorruptCheckpointError, match="dp1-of-2/worker1-of-2"):
        _load_as_dp1(path)
    mine = loader(0, 2)  # DP index 0 does not read that part: it loads
    bcp.load(path, {"dataloader": bcp.DataloaderState(mine, dp_rank=0, dp_size=2)})


def test_a_missing_part_is_named_with_its_dp_index(saved_on_dp2, tmp_path):
    edited = str(tmp_path / "edited")
    assert bcp_cli("edit", "--drop", DP1_PART, saved_on_dp2[0], edited).returncode == 0
    with pytest.raises(bcp.CorruptCheckpointError, match=r"DP index 1 are missing \(workers present: \[0\] of 2\)"):
        _load_as_dp1(edited)
    # every rank checks every DP index, whether or not it reads it: a resharded load needs them all
    with pytest.raises(bcp.CorruptCheckpointError, match="DP index 1"):
        bcp.load(edited, {"dataloader": bcp.DataloaderState(loader(0, 1), dp_rank=0, dp_size=1)})


def test_inspect_lists_the_parts_with_their_sizes(saved_on_dp2):
    shown = bcp_cli("inspect", saved_on_dp2[0]).stdout
    rows = [line.split() for line in shown.splitlines() if line.startswith("dataloader/")]
    assert [row[0] for row in rows] == ["dataloader/replicated", *(f"dataloader/shard/dp{d}-of-2/worker{w}-of-2"
                                                                     for d in (0, 1) for w in (0, 1))]
    assert all(row[-1] == "B" and int(row[-2]) > 0 for row in rows)


def bcp_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bcp.cli", *args], capture_output=True, text=True)
