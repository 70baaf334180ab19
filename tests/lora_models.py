"""A fine-tuning state for incremental saves: a frozen base (linear layers whose weights span more
than one 1 MiB checksum chunk) with low-rank adapters, AdamW over the adapters only."""

from __future__ import annotations

import torch
from torch import nn

from models import batch, rank, world


class LoraMLP(nn.Module):
    """``base*`` are frozen; ``down*``/``up*`` are the trainable adapters. 640 is split unevenly by 3."""

    def __init__(self) -> None:
        super().__init__()
        self.base1 = nn.Linear(12, 640)
        self.base2 = nn.Linear(640, 640)  # 1.6 MB: two checksum chunks
        self.base3 = nn.Linear(640, 7)
        self.down = nn.Linear(640, 4, bias=False)
        self.up = nn.Linear(4, 640, bias=False)
        for layer in (self.base1, self.base2, self.base3):
            layer.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.base1(x))
        h = torch.relu(self.base2(h) + self.up(self.down(h)))
        return self.base3(h)


def build_lora(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = LoraMLP()
    nn.init.normal_(model.up.weight, std=0.02)  # LoRA's up-projection starts at zero; here it trains visibly
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    elif kind != "plain":
        raise ValueError(kind)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def train_lora(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    data_parallel = world() > 1
    for step in steps:
        x, y = batch(step, data_parallel)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def frozen_nbytes(model: nn.Module) -> int:
    """Bytes of the whole frozen base (every rank's shards)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


__all__ = ["LoraMLP", "build_lora", "frozen_nbytes", "rank", "train_lora"]
