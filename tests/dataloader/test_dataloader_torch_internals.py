"""The one place bcp reads torch's and torchdata's dataloaders beyond their public API
(``bcp.torch_internals.dataloader``): this test fails when a torch or torchdata upgrade moves a name
bcp relies on to know what the trainer consumed."""

from __future__ import annotations

import importlib.metadata

import pytest
from torch.utils.data import DataLoader

from bcp.torch_internals import TESTED
from bcp.torch_internals import dataloader as torch_internals
from loader_workers import fork_server

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")


@pytest.mark.parametrize("package", ["torch", "torchdata"])
def test_the_installed_versions_are_the_tested_ones(package):
    version = tuple(int(p.split("+")[0]) for p in importlib.metadata.version(package).split(".")[:2])
    low, high = TESTED[package]
    assert low <= version < high


def test_an_iterators_count_batch_sampler_and_order_are_read():
    loader = DataLoader(range(10), batch_size=3)
    seen = []
    torch_internals.on_new_iterator(loader, seen.append)
    iterator = iter(loader)
    next(iterator)
    assert seen == [iterator]
    assert torch_internals.batches_yielded(iterator) == 1
    assert torch_internals.batch_sampler_of(iterator) is loader.batch_sampler
    assert not torch_internals.reads_ahead(iterator) and torch_internals.in_order(iterator)


def test_a_stateful_loaders_iterator_and_states_are_read():
    loader = stateful_dataloader.StatefulDataLoader(range(10), batch_size=3)
    assert torch_internals.current_iterator(loader) is None
    batches = iter(loader)
    next(batches)
    assert torch_internals.current_iterator(loader) is batches and not torch_internals.finished(loader)
    state = loader.state_dict()
    assert torch_internals.state_batches_yielded(state) == 1 and not torch_internals.state_finished(state)
    loader.load_state_dict(state)
    assert torch_internals.pending_state(loader) == state
    list(iter(loader))
    assert torch_internals.finished(loader) and torch_internals.state_finished(loader.state_dict())
    with_workers = stateful_dataloader.StatefulDataLoader(range(10), batch_size=3, num_workers=2,
                                                         multiprocessing_context=fork_server())
    taken = iter(with_workers)
    next(taken)
    assert torch_internals.state_batches_yielded(with_workers.state_dict()) == 1
    assert torch_internals.state_dataset_states(with_workers.state_dict()) == [None, None]  # one per read worker
    assert torch_internals.state_dataset_states(state) == [None]  # the loader's own
