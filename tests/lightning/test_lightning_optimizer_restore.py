"""A checkpoint saved before the first optimizer step (``Trainer.save_checkpoint`` when training
starts), then a resume from it after training went on: the optimizer comes back empty, as
Lightning's own ``TorchCheckpointIO`` gives it (``torch.optim.Optimizer.load_state_dict`` replaces
the state), and training repeats a fresh run's steps bitwise. Through ``BCPCheckpointIO`` on one
device, and through the bcp strategies on 2 ranks, which load into the live optimizer."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import TorchCheckpointIO

from bcp_lightning import BCPCheckpointIO
from lightning_launch import run
from lightning_worker import Data, LitMLP, SaveAtStart, full_state
from models import assert_bitwise


class OptimizerAtStart(Callback):
    """How many parameters have optimizer state when training starts (after any restore)."""

    def __init__(self) -> None:
        self.with_state: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.with_state = sum(1 for state in trainer.optimizers[0].state.values() if state)


def single_device_fit(io, epochs: int, *, save_at_start=None, resume_from=None) -> tuple[L.Trainer, OptimizerAtStart]:
    at_start = OptimizerAtStart()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False,
                        plugins=[io], callbacks=[at_start, *([SaveAtStart(save_at_start)] if save_at_start else [])])
    trainer.fit(LitMLP(lr=3e-2), datamodule=Data(shuffle=False), ckpt_path=resume_from)
    return trainer, at_start


@pytest.mark.parametrize("io", [BCPCheckpointIO, TorchCheckpointIO])
def test_a_checkpoint_from_before_the_first_step_resumes_with_an_empty_optimizer(tmp_path, io):
    start = str(tmp_path / "start.ckpt")
    trained, _ = single_device_fit(io(), 2, save_at_start=start)
    assert trained.global_step == 24 and trained.optimizers[0].state  # the run went on past the save
    resumed, at_start = single_device_fit(io(), 2, resume_from=start)
    assert at_start.with_state == 0
    assert resumed.global_step == 24
    assert_bitwise(full_state(trained), full_state(resumed))  # the saving run was itself a fresh run


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["bcp_ddp", "bcp_fsdp2"])
def test_the_bcp_strategies_resume_it_with_an_empty_optimizer(tmp_path, strategy):
    """Also guards a defect: saving a never-stepped optimizer through a bcp strategy created its
    state (torch's ``get_optimizer_state_dict`` takes a step at learning rate 0), so the saving run
    and any resume from that checkpoint were one Adam step ahead of a fresh run."""
    r = str(tmp_path)
    start = f"{r}/start.ckpt"

    def fit(name: str, **args) -> dict:
        return {"case": "fit", "args": {"strategy": strategy, "dirpath": f"{r}/{name}", "epochs": 1, **args}}

    cases = [fit("fresh"), fit("first", save_at_start=start), fit("resumed", resume_from=start)]
    for fresh, first, resumed in run(2, cases, f"{r}/launch"):
        assert resumed["restored"]["global_step"] == 0
        assert not [name for name in resumed["restored"]["state"] if name.startswith("optimizer")]
        assert any(name.startswith("optimizer") for name in fresh["final"]["state"])
        assert first["losses"] == resumed["losses"] == fresh["losses"]
        assert_bitwise(fresh["final"]["state"], first["final"]["state"])
        assert_bitwise(fresh["final"]["state"], resumed["final"]["state"])
