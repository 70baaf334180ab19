"""A rank of ``examples/every_step_torchrun.py`` in the fresh-process tier (``zygote.py``): an FSDP2
MLP with AdamW, 2 ranks posing as 2 nodes, an asynchronous, overlapped memory-tier save after every
step (each rank's files copied to the peer node over bcp's gloo groups, in several chunks), the last
one left pending; the script then ends the way the example's users' scripts do."""

from __future__ import annotations

import torch
from torch import nn

import bcp
from lifecycle_jobs import _join, _leave

STEPS = 4


def tier_every_step_then_leave(tier_dir: str, hidden: int, how: str, destroy: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    rank, _ = _join()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tier = bcp.MemoryTier(None, local_dir=tier_dir, nodes=["a", "b"])
    state = {"model": model, "optimizer": optimizer, "extra_state": {"step": 0}}
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :4].sin()).backward()
        optimizer.step()
        state["extra_state"]["step"] = step
        bcp.save(tier, state, async_save=True, overlap=True)
    _leave(how, destroy)
