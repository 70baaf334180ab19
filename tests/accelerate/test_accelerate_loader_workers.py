"""Accelerate's stateful dataloaders with 2 read workers (``use_stateful_dataloader=True``,
``ACCELERATE_CHECKPOINT_ENGINE=bcp``), 96 samples in batches of 4, resumed through ``load_state()`` on
another number of processes: the samples before the save and after it are every sample of the epoch
exactly once, in order, shuffled (``shuffle=True`` with a generator seeded 0: accelerate keeps it in
step across processes and draws each epoch's permutation from it) and with ``use_seedable_sampler``.

2 processes run three epochs uninterrupted, saving after 5 batches of epoch 0 (40 samples: no whole
number of batches on 3 processes), after its last batch and after 5 batches of epoch 2; resumed on 2,
each process takes the very batches of the uninterrupted run (in epoch 2 too, and the epoch after a
save at the end of one is the uninterrupted run's next epoch); on 1, 3 and 4 processes every sample
once. The same from 4 processes to 3 and from 3 to 2.

The defects this guards: another number of processes was refused unless the consumed batches divided
into whole batches per process; with ``use_seedable_sampler`` a resume on the same number walked the
seeded order while the uninterrupted run's first epoch had walked the user's sampler's draw
(accelerate built the loader's first iterator before it swapped the seedable sampler in)."""

from __future__ import annotations

import os

import accelerate
import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

import bcp
from accelerate_helpers import session
from resumed_epochs import BATCH, BEFORE, SIZE, assert_continues, assert_rest_once, chained_runs

pytest.importorskip("torchdata.stateful_dataloader")

SETUPS = ("in order", "shuffled", "seedable")


def _loaders(accelerator, seedable: bool) -> dict[str, DataLoader]:
    names = ("seedable",) if seedable else ("in order", "shuffled")
    return {name: accelerator.prepare(_loader(name != "in order")) for name in names}


def _loader(shuffle: bool, workers: int = 2) -> DataLoader:
    generator = torch.Generator().manual_seed(0) if shuffle else None
    return DataLoader(TensorDataset(torch.arange(SIZE)), batch_size=BATCH, shuffle=shuffle, num_workers=workers,
                      generator=generator)


def _session(seedable: bool):
    torch.manual_seed(0)  # a seedable sampler seeds its orders from the initial seed: alike on every process
    return session("bcp", dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                    use_seedable_sampler=seedable))


def _ids(batch) -> list[int]:
    return batch[0].tolist()


def run_epochs(folder: str, epochs: int = 3, saves: tuple[tuple[int, int], ...] = ((0, BEFORE),),
               resume_from: str | None = None, first_epoch: int = 0) -> dict[str, dict[int, list[int]]]:
    """Per setup, the ids each epoch delivered to this process from ``first_epoch`` on (after
    ``load_state(resume_from)``), saving ``<folder>/<setup>/e<epoch>b<batches>`` after the batches named."""
    seen: dict[str, dict[int, list[int]]] = {}
    for seedable in (False, True):
        with _session(seedable) as accelerator:
            loaders = _loaders(accelerator, seedable)
            if resume_from is not None:
                accelerator.load_state(os.path.join(resume_from, "seedable" if seedable else "default"))
            for epoch in range(first_epoch, epochs):
                for name, loader in loaders.items():
                    seen.setdefault(name, {})[epoch] = []
                taken = {name: iter(loader) for name, loader in loaders.items()}
                for count in range(1, len(loaders["seedable" if seedable else "in order"]) + 1):
                    for name, batches in taken.items():
                        seen[name][epoch] += _ids(next(batches, [torch.tensor([], dtype=torch.long)]))
                    if (epoch, count) in saves:
                        accelerator.save_state(os.path.join(folder, f"e{epoch}b{count}",
                                                            "seedable" if seedable else "default"))
                for name, batches in taken.items():  # a share resumed on another number may end short of len()
                    seen[name][epoch] += [i for batch in batches for i in _ids(batch)]
    return seen


runs = chained_runs(run_epochs)


def test_a_resume_on_the_same_number_of_processes_takes_the_uninterrupted_batches(runs):
    shuffled = runs["uninterrupted"][0]["shuffled"][0]
    assert shuffled != sorted(shuffled)
    assert runs["uninterrupted"][0]["seedable"][0] != runs["uninterrupted"][0]["seedable"][2]  # seeded per epoch
    assert_continues(runs, SETUPS)


@pytest.mark.parametrize("processes", [1, 3, 4])
def test_every_sample_exactly_once_after_load_state_on_another_number_of_processes(runs, processes):
    assert_rest_once(runs, "uninterrupted", f"2 -> {processes}", SETUPS)
    if processes == 3:
        assert_rest_once(runs, "uninterrupted", "2 -> 3 in epoch 2", SETUPS, epoch=2)


@pytest.mark.parametrize("saved_on, resumed_on", [(4, 3), (3, 2)])
def test_every_sample_exactly_once_from_more_processes_to_fewer(runs, saved_on, resumed_on):
    assert_rest_once(runs, f"saved on {saved_on}", f"{saved_on} -> {resumed_on}", SETUPS)


def test_a_shuffled_loader_whose_draw_bcp_did_not_see_is_refused(tmp_path):
    """A loader prepared before bcp_accelerate followed it (here: accelerate's unwrapped
    ``prepare_data_loader``) drew its epoch's order unseen: its save is refused, not saved as a
    position in an order no resume could draw again."""
    prepare = accelerate.Accelerator.prepare_data_loader.__wrapped__
    with _session(False) as accelerator:
        loader = prepare(accelerator, _loader(True, workers=0))
        accelerator._dataloaders.append(loader)
        batches = iter(loader)
        next(batches)
        with pytest.raises(bcp.CheckpointError, match="drew this epoch's order from its generator before bcp "
                                                      "followed it"):
            accelerator.save_state(str(tmp_path / "ckpt"))
