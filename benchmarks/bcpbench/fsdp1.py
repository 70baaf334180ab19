"""FSDP1 (``use_orig_params=True``) save on 2 processes: bcp saves each rank's local flat shards
with no collective beyond planning; DCP first builds FSDP's sharded state dict (which all-gathers
every flat parameter and optimizer state), then saves it. Both are timed from the call until
training may continue (blocking) and until the checkpoint is committed."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import bcp
import torch
import torch.distributed as dist
from torch import nn

from bcpbench import disk
from bcpbench.record import Record, rotated, timed
from bcpbench.rounds import Group

BLOCKING = "FSDP1 save (model + AdamW): blocking, 2 processes"
TOTAL = "FSDP1 save (model + AdamW): call to committed, 2 processes"
BLOCKS = 4
PARAMS_PER_HIDDEN_SQUARED = 12 * BLOCKS


class Block(nn.Module):
    """A GPT-sized block's parameters (fused qkv, 4x MLP, layer norms); attention is simplified,
    the forward pass only has to give every parameter a gradient."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.sigmoid(q * k) * v)
        return x + self.out(torch.relu(self.fc(self.ln_2(x))))


def hidden_for(state_bytes: int) -> int:
    """Hidden size whose parameters plus both AdamW moments (fp32) make about ``state_bytes``."""
    return max(128, round((state_bytes / 12 / PARAMS_PER_HIDDEN_SQUARED) ** 0.5 / 128) * 128)


def build(hidden: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP1, FULL_SHARD, each block wrapped on its own (nested), after one training step so the
    optimizer has state."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    options = {"use_orig_params": True, "device_id": torch.device("cpu")}
    model = nn.Sequential(*[Block(hidden) for _ in range(BLOCKS)])
    for i in range(BLOCKS):
        model[i] = FSDP(model[i], **options)
    model = FSDP(model, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8, hidden)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def run(record: Record, config: dict, group: Group) -> None:
    hidden = hidden_for(config["fsdp1_bytes"])
    model, optimizer = build(hidden)
    nbytes = 3 * 4 * sum(p.numel() for p in _whole_params(hidden))
    record.nbytes[BLOCKING] = record.nbytes[TOTAL] = nbytes
    record.figures["fsdp1 model"] = {"blocks": BLOCKS, "hidden": hidden, "saved_bytes": nbytes}
    state = {"model": model, "optimizer": optimizer}
    state_dict_seconds: list[float] = []
    # DCP's async save runs collectives from its thread: on the main group they would interleave
    # with the training thread's (here: the timing barriers), so it gets a group of its own.
    async_group = dist.new_group(backend="gloo")
    savers: dict[str, Callable[[str], Callable[[], None]]] = {
        "bcp async_save": lambda path: bcp.save(path, state, async_save=True).wait,
        "bcp save": lambda path: _done(bcp.save(path, state)),
        "DCP async_save of FSDP's sharded state dict": lambda path: _dcp(path, model, optimizer, async_group,
                                                                         state_dict_seconds),
        "DCP save of FSDP's sharded state dict": lambda path: _dcp(path, model, optimizer, None,
                                                                   state_dict_seconds),
    }
    for rep in range(-1, config["reps"]):
        if rep == 0:
            state_dict_seconds.clear()  # drop the warm-up round's
        for name in rotated(list(savers), max(rep, 0)):
            path = os.path.join(config["workdir"], f"fsdp1-{rep + 1}")
            blocking, finish = timed(functools.partial(savers[name], path), group.barrier)
            waited, _ = timed(finish, group.barrier)
            if rep >= 0 and group.is_root:
                record.add(BLOCKING, name, blocking)
                record.add(TOTAL, name, blocking + waited)
            if group.is_root:
                disk.remove(path)
            group.barrier()
    record.figures["DCP get_state_dict seconds, FSDP1 (rank 0)"] = state_dict_seconds


def _whole_params(hidden: int) -> list[torch.Tensor]:
    with torch.device("meta"):
        return list(nn.Sequential(*[Block(hidden) for _ in range(BLOCKS)]).parameters())


def _dcp(path: str, model: nn.Module, optimizer: Any, async_group: Any,
         state_dict_seconds: list[float]) -> Callable[[], None]:
    """DCP's recommended path: ``get_state_dict`` (FSDP's sharded state dict), then ``save``, or
    ``async_save`` over ``async_group`` when one is given."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    seconds, (model_state, optimizer_state) = timed(lambda: get_state_dict(model, optimizer))
    state_dict_seconds.append(seconds)
    state = {"model": model_state, "optimizer": optimizer_state}
    writer = dcp.FileSystemWriter(path)
    if async_group is not None:
        return dcp.async_save(state, storage_writer=writer, process_group=async_group).result
    dcp.save(state, storage_writer=writer)
    return _done(None)


def _done(_: Any) -> Callable[[], None]:
    return lambda: None
