"""A followed sampler's epoch order is known by the generator state it was drawn from and drawn
again from it on resume, for the rest of that epoch only (torch's and torchdata's RandomSampler)."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import RandomSampler

from bcp.integration import draws_its_order, drawn_from, follow_order, replay_order

torchdata_sampler = pytest.importorskip("torchdata.stateful_dataloader.sampler")


@pytest.mark.parametrize("cls", [RandomSampler, torchdata_sampler.RandomSampler])
def test_a_replayed_draw_is_the_saved_permutation_then_the_generator_goes_on_as_before(cls):
    uninterrupted = cls(range(50), generator=torch.Generator().manual_seed(3))
    follow_order(uninterrupted)
    epoch0 = list(uninterrupted)
    state = drawn_from(uninterrupted)
    epoch1 = list(uninterrupted)
    assert epoch1 != epoch0

    resumed = cls(range(50), generator=torch.Generator().manual_seed(99))  # a generator elsewhere
    replay_order(resumed, state)
    resumed.set_epoch(0)
    assert list(resumed) == epoch0
    assert list(resumed) == epoch0  # a loader rebuilding its iterator iterates it again: the same order
    resumed.set_epoch(1)
    assert list(resumed) == epoch1  # the next epoch draws what the uninterrupted run drew


def test_following_keeps_the_class_and_pickles_as_the_plain_sampler():
    sampler = RandomSampler(range(10), generator=torch.Generator().manual_seed(0))
    follow_order(sampler)
    follow_order(sampler)  # idempotent
    assert isinstance(sampler, RandomSampler) and draws_its_order(sampler)
    copy = pickle.loads(pickle.dumps(sampler))
    assert type(copy) is RandomSampler and drawn_from(copy) is None


def test_a_sampler_reseeded_from_its_epoch_is_not_followed():
    """Its order is a pure function of its seed and epoch (accelerate's SeedableRandomSampler)."""
    data_loader = pytest.importorskip("accelerate.data_loader")

    assert not draws_its_order(data_loader.SeedableRandomSampler(range(10), data_seed=1))
    assert draws_its_order(RandomSampler(range(10)))
