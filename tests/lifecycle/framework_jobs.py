"""Jobs of the fresh-process tier that go through a framework's own checkpoint calls with bcp
switched on the documented way: a Lightning ``Trainer`` with ``BCPCheckpointIO`` (launched from
outside, as a cluster scheduler starts ranks) and an ``Accelerator`` with
``ACCELERATE_CHECKPOINT_ENGINE=bcp``. They run in processes forked by ``zygote.py``."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))


def lightning_fit_then_leave(root: str, async_save: bool) -> None:
    """Two epochs with a checkpoint each, then a resume from the last one; the script then ends."""
    import lightning as L

    from bcp_lightning import BCPCheckpointIO

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    devices = int(os.environ["WORLD_SIZE"])  # Lightning's teardown after a fit unsets it

    def trainer(epochs: int) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=devices, strategy="ddp",
                         plugins=[BCPCheckpointIO(async_save=async_save)], max_epochs=epochs,
                         default_root_dir=root, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)

    torch.manual_seed(0)
    trainer(2).fit(Regression(), DataLoader(_data(), batch_size=4))
    last = os.path.join(root, "checkpoints", sorted(os.listdir(os.path.join(root, "checkpoints")))[-1])
    trainer(3).fit(Regression(), DataLoader(_data(), batch_size=4), ckpt_path=last)


def accelerate_save_load_then_leave(folder: str) -> None:
    """``save_state`` and ``load_state`` through bcp (the environment switch); the script then ends."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(_data(), batch_size=4))
    for x, y in loader:
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(folder)
    accelerator.load_state(folder)
    accelerator.wait_for_everyone()
