"""Accelerate's stateful dataloaders with 2 read workers (``use_stateful_dataloader=True``,
``ACCELERATE_CHECKPOINT_ENGINE=bcp``), 96 samples in batches of 4: 2 processes take 6 batches each
and ``save_state()``; ``load_state()`` on 2, 1, 3 or 4 processes and the rest of the epoch: the
samples before and after are every sample exactly once, and on 2 processes each process takes the
very batches of the uninterrupted run. In order, and shuffled (``shuffle=True`` with a generator
seeded 0: accelerate keeps it in step across processes and draws each epoch's permutation from it).

The defects this guards: another number of processes was refused, since each process's loader
state was an opaque position within its own shard; shuffled, a resume drew another permutation
from the generator, which had moved on, so samples were lost and repeated silently, on the same
number of processes too."""

from __future__ import annotations

import os

import accelerate
import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

import bcp
import spawned_ranks
from accelerate_helpers import session

pytest.importorskip("torchdata.stateful_dataloader")

SIZE, BATCH, BEFORE = 96, 4, 6  # 2 x 6 batches taken: a whole number of batches on 1, 2, 3 and 4 processes
SHUFFLED = (False, True)


def _loaders(accelerator) -> list:
    return [accelerator.prepare(_loader(shuffle)) for shuffle in SHUFFLED]


def _loader(shuffle: bool, workers: int = 2) -> DataLoader:
    generator = torch.Generator().manual_seed(0) if shuffle else None
    return DataLoader(TensorDataset(torch.arange(SIZE)), batch_size=BATCH, shuffle=shuffle, num_workers=workers,
                      generator=generator)


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
    shuffled = [i for rank in before_and_after for i in rank[1][0]]
    assert shuffled != sorted(shuffled)  # the shuffled loader's order is a permutation, not the identity


def test_a_shuffled_loader_whose_draw_bcp_did_not_see_is_refused(tmp_path):
    """A loader prepared before bcp_accelerate followed it (here: accelerate's unwrapped
    ``prepare_data_loader``) drew its epoch's order unseen: its save is refused, not saved as a
    position in an order no resume could draw again."""
    prepare = accelerate.Accelerator.prepare_data_loader.__wrapped__
    with _session() as accelerator:
        loader = prepare(accelerator, _loader(True, workers=0))
        accelerator._dataloaders.append(loader)
        batches = iter(loader)
        next(batches)
        with pytest.raises(bcp.CheckpointError, match="drew this epoch's order from its generator before bcp "
                                                      "followed it"):
            accelerator.save_state(str(tmp_path / "ckpt"))
