"""Loader states saved by earlier bcp_lightning versions keep resuming: a shuffled loader's state saved
with the generator state of its draw alone (``drawn_from``, before positions) continues the saved
epoch's order, as does the one whose position says it."""

from __future__ import annotations

import torch
from torch.utils.data import RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from bcp.integration import drawn_from, follow_order
from bcp_lightning.loader_states import FitLoopLoaders


def shuffled_loader(seed: int) -> StatefulDataLoader:
    sampler = RandomSampler(range(12), generator=torch.Generator().manual_seed(seed))
    follow_order(sampler)
    return StatefulDataLoader(range(12), batch_size=2, sampler=sampler)


def test_a_state_saved_with_its_draw_alone_resumes_the_saved_epochs_order():
    saving = shuffled_loader(1)
    batches = iter(saving)
    next(batches), next(batches)
    state = saving.state_dict()
    rest = [batch.tolist() for batch in batches]
    legacy = {"loaders": [state], "drawn_from": [drawn_from(saving.sampler)]}  # one rank's part, as saved then

    loaders = FitLoopLoaders()
    loaders.load_dataloader_state(None, [legacy])
    resume = loaders.resumes[0]
    assert (resume.own.version, resume.own.epoch, resume.own.finished) == (0, None, False)
    live, states = shuffled_loader(99), [resume.state]
    resume.apply(None, live, states)
    live.load_state_dict(states[0])  # as the fit loop restores it
    assert [batch.tolist() for batch in live] == rest


def test_a_state_saved_without_positions_or_draw_is_the_loaders_own():
    loaders = FitLoopLoaders()
    loaders.load_dataloader_state(None, [{"loaders": [{"_num_yielded": 3}]}])
    assert loaders.resumes[0].own is None and loaders.resumes[0].state == {"_num_yielded": 3}
