"""A real Trainer saves a snapshot at every step into a memory tier with
``BCPCheckpointIO(memory_tier=tier, async_save=True, overlap=True)`` and
``MemoryTierCheckpoint(every_n_train_steps=1)``: each save returns before the parameters and AdamW
state are copied, the fit's optimizer waits for the copy before it steps, and every generation holds
the state of its step bit for bit although the next step ran while it was copied.

The copy is held back on its thread (``held_copies``) long enough for the next
step's forward and backward, and its update without the wait, to run before it; the tier persists
every generation and keeps them all, so that each step's snapshot is read back after the fit.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import bcp
from bcp.integration import checkpoint_location
from bcp_lightning import MEMORY_TIER, BCPCheckpointIO, MemoryTierCheckpoint
from held_copies import hold_back_copies
from lightning_worker import Data, LitMLP
from models import assert_bitwise

STEPS = 5


def flat(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model and optimizer tensors of a Lightning checkpoint dict, cloned, by name."""
    out = {f"model/{name}": value.detach().clone() for name, value in checkpoint["state_dict"].items()}
    for index, per_param in checkpoint["optimizer_states"][0]["state"].items():
        out.update({f"optimizer/{index}/{key}": torch.as_tensor(value).clone() for key, value in per_param.items()})
    return out


class StateAtSaves(Callback):
    """The state each save is called with, by global step (Lightning builds the dict, then saves it)."""

    def __init__(self) -> None:
        self.saved: dict[int, dict[str, torch.Tensor]] = {}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.saved[trainer.global_step] = flat(checkpoint)


@pytest.fixture
def held_back_copies(monkeypatch) -> list[str]:
    return hold_back_copies(monkeypatch)


def test_a_trainer_saving_every_step_with_overlap_keeps_each_steps_state_bitwise(tmp_path, held_back_copies):
    persistent = tmp_path / "persistent"
    tier = bcp.MemoryTier(persistent, local_dir=tmp_path / "shm", persist_every=1)
    plugin = BCPCheckpointIO(memory_tier=tier, async_save=True, overlap=True, keep_generations=STEPS)
    states = StateAtSaves()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, plugins=[plugin], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, callbacks=[states, MemoryTierCheckpoint(every_n_train_steps=1)])
    trainer.fit(LitMLP(), datamodule=Data(stateful=True))

    assert sorted(states.saved) == list(range(1, STEPS + 1))
    assert len(held_back_copies) == STEPS  # every save left the parameters and AdamW state to its copy
    generations = checkpoint_location(str(persistent), None).generations()
    assert len(generations) == STEPS
    for generation in generations:
        loaded = BCPCheckpointIO(load_generation=generation).load_checkpoint(str(persistent))
        assert_bitwise(states.saved[loaded["global_step"]], flat(loaded))


def test_the_plugins_wait_snapshot_returns_once_the_copy_is_done(tmp_path, held_back_copies):
    """Code that writes parameters outside the optimizer's step waits through the plugin."""
    tier = bcp.MemoryTier(None, local_dir=tmp_path / "shm")
    plugin = BCPCheckpointIO(memory_tier=tier, async_save=True, overlap=True)
    states = StateAtSaves()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, plugins=[plugin], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, callbacks=[states])
    module = LitMLP()
    trainer.fit(module, datamodule=Data(stateful=True))
    trainer.save_checkpoint(MEMORY_TIER)
    plugin.wait_snapshot()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(1.0)  # a write outside optimizer.step() (an EMA into the model, say)
    plugin.wait()
    assert len(held_back_copies) == 1
    assert_bitwise(states.saved[1], flat(plugin.load_checkpoint(MEMORY_TIER)))


def test_overlap_without_async_save_is_refused_at_the_save(tmp_path):
    plugin = BCPCheckpointIO(overlap=True)
    with pytest.raises(bcp.CheckpointError, match="async_save=True"):
        plugin.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, str(tmp_path / "ckpt"))
