"""Stateful loader states saved by earlier bcp_accelerate versions keep resuming: a shuffled loader's
state saved with the generator state of its draw alone (``drawn_from``, before positions) continues
the saved epoch's order at epoch 0, and a part holding the states alone gives each loader its own."""

from __future__ import annotations

import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from accelerate_helpers import session
from bcp.integration import drawn_from
from bcp_accelerate import accelerate_patch
from bcp_accelerate.dataloaders import StatefulLoaders, drawing_sampler

CONFIG = DataLoaderConfiguration(use_stateful_dataloader=True)


def _loader(accelerator, seed: int) -> DataLoader:
    samples = TensorDataset(torch.arange(24))
    return accelerator.prepare(DataLoader(samples, batch_size=4, shuffle=True,
                                          generator=torch.Generator().manual_seed(seed)))


def _saved_mid_epoch() -> tuple[dict, torch.Tensor, list[list[int]]]:
    """A loader's state after two batches, the draw of its epoch and the batches after them."""
    with session("bcp", dataloader_config=CONFIG) as accelerator:
        loader = _loader(accelerator, seed=11)
        batches = iter(loader)
        next(batches), next(batches)
        state, draw = loader.state_dict(), drawn_from(drawing_sampler(loader))
        return state, draw, [batch[0].tolist() for batch in batches]


def test_a_state_saved_with_its_draw_alone_resumes_the_saved_epochs_order():
    state, draw, rest = _saved_mid_epoch()
    with session("bcp", dataloader_config=CONFIG) as accelerator:
        loader = _loader(accelerator, seed=99)
        accelerate_patch.set_loader_epoch(loader, 3)
        StatefulLoaders([loader]).load_dataloader_state(None, [{"loaders": {"0": state}, "drawn_from": {"0": draw}}])
        assert accelerate_patch.loader_epoch(loader) == 0
        assert [batch[0].tolist() for batch in loader] == rest


def test_a_part_of_states_alone_gives_each_loader_its_own():
    state, _, rest = _saved_mid_epoch()
    with session("bcp", dataloader_config=CONFIG) as accelerator:
        loader = _loader(accelerator, seed=11)
        StatefulLoaders([loader]).load_dataloader_state(None, [{"0": state}])
        assert len(list(loader)) == len(rest)  # its state's place in the epoch (the order is drawn anew)
