"""A loader's saved position read as one typed record from every shape a checkpoint holds (the
position of today, the draw saved alone before positions), and the resume steps the integrations
share: a loader continuing its own state replays the saved draw at the saved epoch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler

import bcp
from bcp.integration import (SavedPosition, batching_of, consumed_batches, continue_own, drawn_from, follow_order,
                             order_of_sampler)

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")


def drawn_sampler(seed: int) -> RandomSampler:
    sampler = RandomSampler(range(8), generator=torch.Generator().manual_seed(seed))
    follow_order(sampler)
    return sampler


def test_a_position_of_today_is_read_as_saved():
    sampler = drawn_sampler(1)
    list(sampler)
    generator = sampler.generator.get_state().numpy().tobytes()
    order = {"kind": "through", "outer": {"kind": "sequence", "size": 8}, "inner": order_of_sampler(sampler)}
    saved = {"order": order, "length": 8, "epoch": 2,
             "walk": {"world": 2, "rank": 1, "first": 0, "end": 4, "unit": 1, "done": 2}, "finished": False,
             "batch_size": 2, "batch_drop_last": False, "drop": False, "generator": generator, "resumed": True}
    position = SavedPosition.read(saved)
    assert (position.version, position.epoch, position.finished, position.resumed) == (1, 2, False, True)
    assert position.saved is saved and position.generator == generator and position.next_epoch() == 2
    assert position.drawn_generator() == drawn_from(sampler).numpy().tobytes()
    # saved before the "resumed" flag: its own share
    assert not SavedPosition.read({k: v for k, v in saved.items() if k != "resumed"}).resumed


def test_a_draw_saved_alone_before_positions_is_read_and_replayed():
    sampler = drawn_sampler(2)
    saved_epoch = list(sampler)
    legacy = drawn_from(sampler)  # as checkpoints held it: a uint8 tensor of the generator state
    assert legacy.dtype == torch.uint8
    list(sampler)  # the generator moved on
    position = SavedPosition.read(None, legacy)
    assert (position.version, position.epoch, position.finished, position.saved) == (0, None, False, None)
    epochs = []
    continue_own(position, sampler, epochs.append, loader="test loader")
    assert epochs == [None] and list(sampler) == saved_epoch
    assert SavedPosition.read(None, None) is None


def test_a_finished_epoch_continues_with_the_next_epochs_draw():
    uninterrupted = drawn_sampler(3)
    list(uninterrupted)
    saved = {"order": order_of_sampler(uninterrupted), "length": 8, "epoch": 4,
             "walk": {"world": 1, "rank": 0, "first": 0, "end": 8, "unit": 1, "done": 8}, "finished": True,
             "batch_size": 2, "batch_drop_last": False, "drop": False,
             "generator": uninterrupted.generator.get_state().numpy().tobytes()}
    resumed, epochs = drawn_sampler(99), []
    continue_own(SavedPosition.read(saved), resumed, epochs.append, loader="test loader")
    assert epochs == [5] and list(resumed) == list(uninterrupted)


def test_a_drawn_order_needs_a_drawing_sampler():
    position = SavedPosition.read(None, drawn_from(_iterated(drawn_sampler(4))))
    with pytest.raises(bcp.MismatchError, match="a test loader was saved with an order drawn from a generator"):
        continue_own(position, None, lambda epoch: None, loader="test loader")


def _iterated(sampler: RandomSampler) -> RandomSampler:
    list(sampler)
    return sampler


def test_batching_and_consumed_batches_of_torchs_and_torchdatas_loaders():
    assert batching_of(BatchSampler(range(8), 3, drop_last=True)) == (3, True)
    assert batching_of([[0, 1], [2]]) == (None, False)  # a custom batch sampler
    loader = stateful_dataloader.StatefulDataLoader(range(8), batch_size=2)
    batches = iter(loader)
    next(batches), next(batches)
    assert consumed_batches(loader.state_dict()) == (2, False)
    assert consumed_batches({"epoch": 3}) is None  # another loader's state
