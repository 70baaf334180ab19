"""bcp_lightning's plugin, strategies and options pickle, and so do a LightningModule and its Trainer
after a fit checkpointed through them: pickling them failed with ``cannot pickle '_thread.lock'``
(the plugin's record of pending saves holds a lock), where Lightning's own ``TorchCheckpointIO``
pickles. Real Trainers: in this process, and under DDP on two processes."""

from __future__ import annotations

import pickle

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import bcp
import bcp_lightning
import bcp_lightning.pytorch_lightning as standalone
from bcp_lightning import BCPCheckpointIO, BCPDDPStrategy, BCPFSDPStrategy, BCPModelParallelStrategy, Options
from lightning_launch import run
from lightning_worker import Data, LitMLP
from models import assert_bitwise


def round_trip(value):
    return pickle.loads(pickle.dumps(value))


def test_options_round_trip():
    options = Options.of(async_save=True, allow_pickle=True, verify=False, io_threads=3)
    assert round_trip(options) == options


@pytest.mark.parametrize("package", [bcp_lightning, standalone], ids=["lightning", "pytorch_lightning"])
def test_plugin_round_trips_with_its_options_and_saves_afterwards(package, tmp_path):
    plugin = package.BCPCheckpointIO(async_save=True, io_threads=2)
    plugin.save_checkpoint({"state_dict": {"w": torch.arange(4.0)}, "epoch": 1}, tmp_path / "a")
    copy = round_trip(plugin)  # with a save possibly still committing in the background
    assert type(copy) is type(plugin) and copy.options == plugin.options
    # the copy has a working record of its own saves (a fresh lock)
    copy.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "epoch": 2}, tmp_path / "b")
    copy.wait()
    plugin.wait()
    assert_bitwise(copy.load_checkpoint(tmp_path / "a")["state_dict"], {"w": torch.arange(4.0)})
    assert copy.load_checkpoint(tmp_path / "b")["epoch"] == 2


def test_plugin_with_a_memory_tier_and_the_tier_callback_round_trip(tmp_path):
    memory_tier = bcp.MemoryTier(tmp_path / "persistent", local_dir=tmp_path / "shm", persist_every=3)
    plugin = BCPCheckpointIO(memory_tier=memory_tier)
    plugin.save_checkpoint({"state_dict": {"w": torch.arange(4.0)}, "epoch": 1}, bcp_lightning.MEMORY_TIER)
    copy = round_trip(plugin)
    assert copy.memory_tier == memory_tier and copy.options == plugin.options
    assert_bitwise(copy.load_checkpoint(bcp_lightning.MEMORY_TIER)["state_dict"], {"w": torch.arange(4.0)})
    callback = round_trip(bcp_lightning.MemoryTierCheckpoint(every_n_train_steps=5))
    assert type(callback) is bcp_lightning.MemoryTierCheckpoint and callback.every_n_train_steps == 5


@pytest.mark.parametrize("cls", [BCPDDPStrategy, BCPFSDPStrategy, BCPModelParallelStrategy])
def test_strategies_round_trip_with_their_plugin(cls, tmp_path):
    strategy = cls()
    strategy.checkpoint_io = BCPCheckpointIO(async_save=True)
    strategy.checkpoint_io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "ckpt")
    copy = round_trip(strategy)
    assert type(copy) is type(strategy) and copy.checkpoint_io.options == strategy.checkpoint_io.options
    strategy.checkpoint_io.wait()


@pytest.mark.parametrize("strategy, plugin", [("single", True), ("bcp_ddp", False), ("single", False)],
                         ids=["plugin", "bcp_ddp_strategy", "async_plugin"])
def test_torch_save_of_a_model_after_fit_in_this_process(strategy, plugin, tmp_path):
    from lightning_worker import STRATEGIES
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=STRATEGIES[strategy](),
                        plugins=[BCPCheckpointIO(async_save=not plugin)] if strategy == "single" else None,
                        max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    model = LitMLP()
    trainer.fit(model, datamodule=Data())
    assert isinstance(trainer.strategy.checkpoint_io, BCPCheckpointIO)
    torch.save(model, tmp_path / "model.pt")
    reloaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(reloaded) is LitMLP
    assert_bitwise(reloaded.state_dict(), model.state_dict())
    # the trainer, which holds the plugin, pickles as it does with Lightning's own TorchCheckpointIO
    copy = round_trip(trainer)
    assert copy.strategy.checkpoint_io.options == trainer.strategy.checkpoint_io.options
    assert bcp.load(tmp_path / "last.ckpt", {"model": LitMLP(), "lightning": None}).loaded


def test_torch_save_of_a_model_after_fit_under_ddp_on_two_processes(tmp_path):
    cases = [{"case": "pickle_model", "args": {"strategy": "ddp", "dirpath": str(tmp_path / "plugin"),
                                               "plugin": True}},
             {"case": "pickle_model", "args": {"strategy": "bcp_ddp", "dirpath": str(tmp_path / "strategy"),
                                               "async_save": True}}]
    results = run(2, cases, str(tmp_path / "launch"))
    for rank_results in results:
        for result in rank_results:
            assert result["classes"] == ["LitMLP", "BCPCheckpointIO"] and result["same_options"]
            assert_bitwise(result["reloaded"], result["live"])
