"""Accelerator sessions, a small training loop and state snapshots for the accelerate cases.

The cases run on the shared pool's ranks, so every session leaves the process as it found it:
accelerate's global state is reset and ``ACCELERATE_CHECKPOINT_ENGINE`` restored on exit.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType
from torch import nn

import bcp_accelerate
from models import MLP, assert_bitwise, batch, full_state, rank, world

SAVED_AT = 3
STEPS = 6


class Net(nn.Module):
    """The shared uneven MLP with dropout after it, so resuming depends on the restored RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.mlp(x))


class Counter:
    """An object registered for checkpointing (``register_for_checkpointing``)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


@contextlib.contextmanager
def session(engine: str | None = None, *, fsdp2: bool = False, **kwargs: Any) -> Iterator[Accelerator]:
    """A fresh CPU Accelerator while ``ACCELERATE_CHECKPOINT_ENGINE`` is ``engine`` (None: unset)."""
    previous = os.environ.pop(bcp_accelerate.ENGINE_VARIABLE, None)
    if engine is not None:
        os.environ[bcp_accelerate.ENGINE_VARIABLE] = engine
    try:
        yield _fsdp2_accelerator(**kwargs) if fsdp2 else Accelerator(cpu=True, **kwargs)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        os.environ.pop(bcp_accelerate.ENGINE_VARIABLE, None)
        if previous is not None:
            os.environ[bcp_accelerate.ENGINE_VARIABLE] = previous


def _fsdp2_accelerator(**kwargs: Any) -> Accelerator:
    # Accelerate selects FSDP only on GPUs and other accelerators; on the CPU it would wrap the model
    # in DDP. Setting the distributed type its launcher sets there lets its own FSDP2 preparation
    # (fully_shard, optimizer parameter swap) run on gloo.
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, **kwargs)
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def build(accelerator: Accelerator, seed: int) -> tuple[Any, Any, Any]:
    """Model, optimizer and LR scheduler, prepared."""
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return accelerator.prepare(model, optimizer, scheduler)


def train(accelerator: Accelerator, model: Any, optimizer: Any, scheduler: Any, steps: range) -> list[float]:
    """Run ``steps``; the global mean loss of each."""
    losses = []
    for step in steps:
        x, y = batch(step, data_parallel=world() > 1)
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return losses


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "random": random.getstate(), "numpy": np.random.get_state()}


def scramble_rng() -> None:
    random.seed(77)
    np.random.seed(77)
    torch.manual_seed(77)


def snapshot(accelerator: Accelerator, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """Everything a resume must restore, on this rank (collective for sharded models)."""
    return {"tensors": full_state(model, optimizer), "scheduler": scheduler.state_dict(), "step": accelerator.step,
            "lr": [g["lr"] for g in optimizer.param_groups], "rng": rng_state()}


def assert_restored(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    assert_bitwise(expected["tensors"], actual["tensors"])
    assert expected["scheduler"] == actual["scheduler"]
    assert expected["step"] == actual["step"]
    assert expected["lr"] == actual["lr"]
    assert torch.equal(expected["rng"]["torch"], actual["rng"]["torch"])
    assert expected["rng"]["random"] == actual["rng"]["random"]
    saved_np, live_np = expected["rng"]["numpy"], actual["rng"]["numpy"]
    assert saved_np[0] == live_np[0] and np.array_equal(saved_np[1], live_np[1]) and saved_np[2:] == live_np[2:]


# Cases shared by the DDP and FSDP2 tests.


def resume_matches_uninterrupted(path: str, saved: list[dict], fsdp2: bool, registered: Sequence[Any] = ()) -> None:
    """Load the checkpoint saved after ``SAVED_AT`` steps into fresh objects with scrambled RNG
    (and the ``registered`` objects registered for checkpointing, as the save had them):
    everything is restored, and the next steps equal those of an uninterrupted run, bitwise."""
    with session(fsdp2=fsdp2) as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=1)
        reference = train(accelerator, model, optimizer, scheduler, range(STEPS))
        final = full_state(model, optimizer)
    with session("bcp", fsdp2=fsdp2) as accelerator:
        for obj in registered:
            accelerator.register_for_checkpointing(obj)
        model, optimizer, scheduler = build(accelerator, seed=2)
        scramble_rng()
        accelerator.load_state(path)
        assert_restored(saved[rank()], snapshot(accelerator, model, optimizer, scheduler))
        assert train(accelerator, model, optimizer, scheduler, range(SAVED_AT, STEPS)) == reference[SAVED_AT:]
        assert_bitwise(final, full_state(model, optimizer))


def load_on_one_process(path: str, saved_rank0: dict) -> list[float]:
    """Load a checkpoint saved by several processes into one (resharded); training goes on."""
    with session("bcp") as accelerator:
        assert accelerator.num_processes == 1
        model, optimizer, scheduler = build(accelerator, seed=2)
        scramble_rng()
        accelerator.load_state(path)
        assert_restored(saved_rank0, snapshot(accelerator, model, optimizer, scheduler))
        return train(accelerator, model, optimizer, scheduler, range(SAVED_AT, STEPS))
