"""Accelerate training that saves and resumes through bcp, and resumes with any number of processes.

Run it (CPU, 2 processes), then resume the same run on 1 process:

    ACCELERATE_CHECKPOINT_ENGINE=bcp ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 \\
        torchrun --standalone --nproc_per_node 2 examples/accelerate/train.py --project-dir /tmp/bcp-run --steps 4
    ACCELERATE_CHECKPOINT_ENGINE=bcp ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 \\
        torchrun --standalone --nproc_per_node 1 examples/accelerate/train.py --project-dir /tmp/bcp-run --steps 8

The only bcp-specific line is ``import bcp_accelerate``; the environment variable switches the
engine on (unset, accelerate's own ``save_state``/``load_state`` run unchanged).
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch import nn

import bcp_accelerate  # noqa: F401  (lets ACCELERATE_CHECKPOINT_ENGINE=bcp take over save_state/load_state)

GLOBAL_BATCH = 16


class Progress:
    """The training step, saved and restored with the checkpoint (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def batch(step: int, accelerator: Accelerator) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's share of the global batch of ``step``: the same data for any process count."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=generator)
    y = x[:, :4].sin() + 0.1 * torch.randn(GLOBAL_BATCH, 4, generator=generator)
    share = GLOBAL_BATCH // accelerator.num_processes
    rows = slice(accelerator.process_index * share, (accelerator.process_index + 1) * share)
    return x[rows], y[rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project-dir", required=True)
    parser.add_argument("--steps", type=int, default=8, help="train until this global step")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--total-limit", type=int, default=2, help="checkpoints to keep")
    args = parser.parse_args()

    accelerator = Accelerator(project_config=ProjectConfiguration(
        project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=args.total_limit))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    if os.path.isdir(os.path.join(args.project_dir, "checkpoints")):
        accelerator.load_state()  # the newest committed checkpoint, whatever process count wrote it
        accelerator.print(f"resumed at step {progress.step} on {accelerator.num_processes} process(es)")

    while progress.step < args.steps:
        x, y = batch(progress.step, accelerator)
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.step += 1
        mean_loss = accelerator.reduce(loss.detach(), "mean").item()
        accelerator.print(f"step {progress.step} loss {mean_loss:.6f}")
        if progress.step % args.save_every == 0:
            folder = accelerator.save_state()
            accelerator.print(f"saved {folder}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
