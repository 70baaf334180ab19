"""torchdata's StatefulDataLoader (2 read workers per rank) through the ``dataloader`` component:
saved per DP index, resumed mid-epoch on the same DP size with identical batches; a DP change is
refused with a clear error (its state is a position within its own DP shard).

Its worker processes cannot be children of the daemonic rank pool, so the two ranks here are
started with ``torch.multiprocessing.spawn``."""

from __future__ import annotations

import datetime
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp_mp
from torch.utils.data.distributed import DistributedSampler

import bcp

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

WORLD, BEFORE, AFTER = 2, 3, 4


class Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> list[int]:
        return [i, i * i]


def _loader(rank: int) -> "stateful_dataloader.StatefulDataLoader":
    sampler = DistributedSampler(Squares(), num_replicas=WORLD, rank=rank, shuffle=True, seed=3)
    return stateful_dataloader.StatefulDataLoader(Squares(), batch_size=3, sampler=sampler, num_workers=2)


def _batches(iterator, n: int) -> list:
    return [[t.tolist() for t in next(iterator)] for _ in range(n)]


def _rank_main(rank: int, port: int, folder: str, phase: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        loader = _loader(rank)
        state = {"dataloader": bcp.DataloaderState(loader, dp_rank=rank, dp_size=WORLD)}
        if phase == "save":
            iterator = iter(loader)
            _batches(iterator, BEFORE)
            bcp.save(os.path.join(folder, "ckpt"), state)
            out = _batches(iterator, AFTER)
        else:
            bcp.load(os.path.join(folder, "ckpt"), state)
            out = _batches(iter(loader), AFTER)
        with open(os.path.join(folder, f"{phase}-{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def _run(folder: str, phase: str) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp_mp.spawn(_rank_main, args=(port, folder, phase), nprocs=WORLD, join=True)
    return [json.load(open(os.path.join(folder, f"{phase}-{rank}.json"))) for rank in range(WORLD)]


def test_stateful_dataloader_resumes_mid_epoch_with_identical_batches(tmp_path):
    expected = _run(str(tmp_path), "save")
    resumed = _run(str(tmp_path), "load")
    assert resumed == expected
    assert expected[0] != expected[1]  # each DP index got its own position back, not rank 0's
    # a DP change cannot be made exact for an opaque state_dict: refused, saying why
    with pytest.raises(bcp.MismatchError, match="saved on 2 DP ranks and is loaded on 1"):
        bcp.load(str(tmp_path / "ckpt"), {"dataloader": bcp.DataloaderState(_loader(0), dp_rank=0, dp_size=1)})
