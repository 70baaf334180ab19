"""Lightning training checkpointed through bcp, resumed on another device count and strategy.

    python examples/lightning/train.py --devices 2 --strategy ddp --epochs 2
    python examples/lightning/train.py --devices 1 --strategy fsdp2 --epochs 4

The first run trains with DDP on two CPU processes (Lightning starts the second one) and saves a
checkpoint every epoch; the second resumes the last one with FSDP2 on one process: the model and
the optimizer state are resharded on load, and the epoch, step, scheduler and callbacks continue.
The switch to bcp is one line: ``strategy=BCPDDPStrategy()`` where Lightning's own would be
``strategy="ddp"`` (or ``plugins=[BCPCheckpointIO()]`` with Lightning's strategies, for single
device and DDP).
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from bcp_lightning import BCPCheckpointIO, BCPDDPStrategy, BCPModelParallelStrategy


class Regressor(L.LightningModule):
    def __init__(self, width: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 1))

    def configure_model(self) -> None:
        # Under ModelParallelStrategy, shard each layer (FSDP2) over the data-parallel ranks.
        if self.device_mesh is not None and not hasattr(self.net[0].weight, "placements"):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.8)}


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--dir", default="lightning_checkpoints", help="where checkpoints go")
    args = parser.parse_args()

    strategy = {
        "ddp": lambda: BCPDDPStrategy(),
        "fsdp2": lambda: BCPModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
    }[args.strategy]()
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_epochs=args.epochs,
        strategy=strategy,  # <- the switch: Lightning's own would be strategy="ddp"
        plugins=[BCPCheckpointIO(async_save=True)],  # optional: save in the background
        callbacks=[ModelCheckpoint(dirpath=args.dir, save_last=True)], logger=False, enable_progress_bar=False)
    last = os.path.join(args.dir, "last.ckpt")
    trainer.fit(Regressor(), data(), ckpt_path="last" if os.path.exists(last) else None)
    if trainer.is_global_zero:
        print(f"{args.strategy} on {args.devices} device(s): epoch {trainer.current_epoch}, step "
              f"{trainer.global_step}, loss {trainer.callback_metrics['loss']:.4f}; checkpoints in {args.dir}")


if __name__ == "__main__":
    main()
