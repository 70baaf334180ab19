"""128 MB of token buffers (2 DP ranks x 2 read workers x 32 MB): each DP index's writer writes its
own parts, its two workers' parts into two data files (one writer thread each), not one after
another through one rank (the paper's dataloader stragglers, section 6.4); they load back bitwise."""

from __future__ import annotations

import torch.distributed as dist

import bcp
from bcp.api.checkpoint import open_checkpoint
from dataloader_streams import loader

TOKENS = 4 << 20  # int64: 32 MB per read worker


def _buffer(dp: int, worker: int) -> list[int]:
    start = (2 * dp + worker) * TOKENS
    return list(range(start, start + TOKENS))


def save_big(path: str) -> None:
    rank = dist.get_rank()
    mine = loader(rank, 2)
    for worker, reader in enumerate(mine.readers):
        reader.buffer = _buffer(rank, worker)
    bcp.save(path, {"dataloader": bcp.DataloaderState(mine, dp_rank=rank, dp_size=2)})


def load_big(path: str) -> bool:
    rank = dist.get_rank()
    mine = loader(rank, 2)
    bcp.load(path, {"dataloader": bcp.DataloaderState(mine, dp_rank=rank, dp_size=2)})
    return [reader.buffer for reader in mine.readers] == [_buffer(rank, 0), _buffer(rank, 1)]


def test_large_buffers_are_written_in_parallel_and_load_back(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_big, path)
    checkpoint = open_checkpoint(path)
    files = {name: checkpoint.manifest.files[entry.records[0][0].file]
             for name, entry in checkpoint.objects.items() if "/shard/" in name}
    for dp in (0, 1):
        mine = [files[f"dataloader/shard/dp{dp}-of-2/worker{w}-of-2"] for w in (0, 1)]
        assert all(name.startswith(f"data/{dp:05d}-") for name in mine), mine  # written by DP index dp's writer
        assert len(set(mine)) == 2, mine  # by two writer threads
    assert ranks(2).run(load_big, path) == [True, True]
