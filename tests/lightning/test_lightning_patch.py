"""The one place bcp_lightning reaches into Lightning beyond its public API (``lightning_patch``):
this test fails when a Lightning upgrade moves a name it relies on, instead of bcp_lightning silently
losing the train loaders of fits under Lightning's own strategies."""

from __future__ import annotations

import importlib.metadata
import inspect

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.core import saving
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loops import fit_loop
from lightning.pytorch.strategies import Strategy

from bcp.integration import MovedNameError
from bcp_lightning import BCPCheckpointIO, BCPDDPStrategy, lightning_patch


def test_the_installed_lightning_is_one_bcp_lightning_follows():
    version = tuple(int(p) for p in importlib.metadata.version("lightning").split(".")[:2])
    assert lightning_patch.TESTED[0] <= version < lightning_patch.TESTED[1]
    BCPCheckpointIO()  # installs the patch
    patched = fit_loop._process_dataloader
    assert getattr(patched, "_bcp_follows_train_loaders", False)
    assert list(inspect.signature(patched.__wrapped__).parameters) == ["trainer", "trainer_fn", "stage", "dataloader"]
    assert lightning_patch.unavailable(L.Trainer(logger=False)) is None


def test_the_private_names_read_exist():
    trainer = L.Trainer(logger=False, enable_checkpointing=False)
    assert trainer.fit_loop._combined_loader is None and trainer.fit_loop._combined_loader_states_to_load == []
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    assert all(isinstance(getattr(current, name), int) for name in ("ready", "started", "processed", "completed"))
    inner = torch.utils.data.RandomSampler(range(8))
    wrapper = DistributedSamplerWrapper(inner, num_replicas=1, rank=0)
    assert lightning_patch.wrapped_sampler(wrapper) is inner
    # bcp_lightning's strategies see their loaders through Lightning's public hook instead
    assert "process_dataloader" in vars(Strategy) and BCPDDPStrategy.follows_train_loaders


def test_another_lightning_version_is_left_unpatched_with_the_reason(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.0.0")
    reason = lightning_patch._why_not("lightning", fit_loop._process_dataloader.__wrapped__)
    assert reason == "lightning 9.0 is outside the versions bcp_lightning follows the fit loop's train loaders in " \
                     "(2.1 to before 2.7)"
    monkeypatch.undo()
    assert "has no _process_dataloader" in lightning_patch._why_not("lightning", lambda trainer, stage: None)


def test_the_optimizer_inside_lightnings_wrapper_and_the_module_builder_are_read_by_name():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert lightning_patch.torch_optimizer(LightningOptimizer(optimizer)) is optimizer
    assert lightning_patch.torch_optimizer(optimizer) is optimizer
    saved = Scaled(factor=3.0)
    checkpoint = {"state_dict": saved.state_dict(), Scaled.CHECKPOINT_HYPER_PARAMS_KEY: {"factor": 3.0},
                  "pytorch-lightning_version": L.__version__}
    built = lightning_patch.module_from_checkpoint(Scaled, checkpoint, strict=True)
    assert built.factor == 3.0 and torch.equal(built.layer.weight, saved.layer.weight)


def test_a_moved_module_builder_fails_naming_it_and_the_tested_versions(monkeypatch):
    monkeypatch.delattr(saving, "_load_state")
    with pytest.raises(MovedNameError, match=r"lightning.pytorch.core.saving._load_state is missing: bcp reads this "
                                             r"private name of lightning, tested with lightning 2\.1 to before 2\.7"):
        lightning_patch.module_from_checkpoint(Scaled, {}, strict=True)


class Scaled(L.LightningModule):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.factor = factor
        self.layer = torch.nn.Linear(2, 2)
