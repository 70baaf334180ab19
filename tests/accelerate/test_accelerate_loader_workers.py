"""Accelerate's stateful dataloaders with 2 read workers (``use_stateful_dataloader=True``,
``ACCELERATE_CHECKPOINT_ENGINE=bcp``), 96 samples in batches of 4: 2 processes take 6 batches each
and ``save_state()``; ``load_state()`` on 2, 1, 3 or 4 processes and the rest of the epoch: the
samples before and after are every sample exactly once, and on 2 processes each process takes the
very batches of the uninterrupted run. In order (shuffled loaders: docs/dataloader.md).

The defect this guards: another number of processes was refused, since each process's loader
state was an opaque position within its own shard."""

from __future__ import annotations

import os

import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

import spawned_ranks
from accelerate_helpers import session

pytest.importorskip("torchdata.stateful_dataloader")

SIZE, BATCH, BEFORE = 96, 4, 6  # 2 x 6 batches taken: a whole number of batches on 1, 2, 3 and 4 processes
SHUFFLED = (False,)


def _loaders(accelerator) -> list:
    return [accelerator.prepare(DataLoader(TensorDataset(torch.arange(SIZE)), batch_size=BATCH, shuffle=shuffle,
                                           num_workers=2)) for shuffle in SHUFFLED]


def _session():
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    return session("bcp", dataloader_config=config)


def save_mid_epoch(path: str) -> list[tuple[list[int], list[int]]]:
    """Per loader: the samples before the save and those the uninterrupted run takes after it."""
    with _session() as accelerator:
        iterators = [iter(loader) for loader in _loaders(accelerator)]
        before = [[i for _ in range(BEFORE) for i in next(it)[0].tolist()] for it in iterators]
        accelerator.save_state(path)
        return [(taken, [i for batch in it for i in batch[0].tolist()]) for taken, it in zip(before, iterators)]


def resume(path: str) -> list[list[int]]:
    with _session() as accelerator:
        loaders = _loaders(accelerator)
        accelerator.load_state(path)
        return [[i for batch in loader for i in batch[0].tolist()] for loader in loaders]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = os.path.join(str(tmp_path_factory.mktemp("accelerate-workers")), "ckpt")
    return path, spawned_ranks.run(2, save_mid_epoch, path)


@pytest.mark.parametrize("processes", [2, 1, 3, 4])
def test_every_sample_exactly_once_after_load_state_on_any_number_of_processes(saved, processes):
    path, before_and_after = saved
    resumed = spawned_ranks.run(processes, resume, path)
    for k, shuffle in enumerate(SHUFFLED):
        before = [i for rank in before_and_after for i in rank[k][0]]
        after = [i for rank in resumed for i in rank[k]]
        assert sorted(before + after) == list(range(SIZE)), f"shuffle={shuffle}"
        if processes == 2:
            assert [rank[k] for rank in resumed] == [rank[k][1] for rank in before_and_after], f"shuffle={shuffle}"
