"""Accelerate's stateful dataloaders (``use_stateful_dataloader=True``) saved through bcp: a run
resumed mid-epoch on 2 processes sees exactly the batches the uninterrupted run saw, and the
loaders' state lies in the bcp checkpoint (one part per process), not in accelerate's files."""

from __future__ import annotations

import os

import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from accelerate_helpers import build, session, train
from bcp.api.checkpoint import open_checkpoint

BEFORE, AFTER = 3, 4  # batches before the save, batches after it (this epoch has 8 per process)


def _loader(accelerator) -> DataLoader:
    torch.manual_seed(5)
    samples = TensorDataset(torch.arange(64))
    generator = torch.Generator().manual_seed(11)
    return accelerator.prepare(DataLoader(samples, batch_size=4, shuffle=True, generator=generator))


def _batches(loader, count: int) -> list[list[int]]:
    taken = iter(loader)
    return [next(taken)[0].tolist() for _ in range(count)]


def _stateful_session():
    # The seedable sampler's epoch and seed stay in accelerate's files; the position in the epoch
    # is the loader's state, which bcp holds.
    config = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)
    return session("bcp", dataloader_config=config)


def save_mid_epoch(path: str) -> tuple[list, list]:
    """Batches before the save and the batches an uninterrupted run takes after it."""
    with _stateful_session() as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=1)
        train(accelerator, model, optimizer, scheduler, range(1))  # so that there is optimizer state
        loader = _loader(accelerator)
        batches = iter(loader)
        before = [next(batches)[0].tolist() for _ in range(BEFORE)]
        accelerator.save_state(path)
        return before, [next(batches)[0].tolist() for _ in range(AFTER)]


def resume(path: str) -> list:
    with _stateful_session() as accelerator:
        build(accelerator, seed=1)
        loader = _loader(accelerator)
        accelerator.load_state(path)
        return _batches(loader, AFTER)


def test_a_resumed_run_sees_the_batches_of_an_uninterrupted_run(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = ranks(2).run(save_mid_epoch, path)
    assert saved[0][0] != saved[1][0]  # the processes read different shards of the data
    assert ranks(2).run(resume, path) == [after for _, after in saved]
    parts = sorted(name for name in open_checkpoint(path).objects if name.startswith("dataloader/"))
    assert parts == ["dataloader/replicated", "dataloader/shard/dp0-of-2/worker0-of-1",
                     "dataloader/shard/dp1-of-2/worker0-of-1"]
    files_dir = next(name for name in os.listdir(path) if name.startswith("accelerate-"))
    assert not [name for name in os.listdir(f"{path}/{files_dir}") if name.startswith("dl_state_dict")]
