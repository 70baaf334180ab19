"""BCPCheckpointIO with real single-device Trainer runs in this process: everything Lightning keeps
survives, ModelCheckpoint's top-k removal, ``save_last`` (rewrite and link) and ``ckpt_path="last"``
work, and every misuse a user can hit fails with a message saying what to do."""

from __future__ import annotations

import copy
import dataclasses
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.precision import Precision

import bcp
from bcp.engine.location import METRICS_DIR
from bcp_lightning import BCPCheckpointIO, BCPDDPStrategy
from lightning_worker import Data, LitMLP, full_state
from models import assert_bitwise


class RecordingIO(BCPCheckpointIO):
    """BCPCheckpointIO that keeps a deep copy of every dict it is given to save."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.saved: dict[str, dict] = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.saved[os.fspath(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


class CountingPrecision(Precision):
    """A precision plugin with state, as Lightning checkpoints it."""

    def __init__(self) -> None:
        self.steps = 0

    def optimizer_step(self, *args, **kwargs):
        self.steps += 1
        return super().optimizer_step(*args, **kwargs)

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps = state_dict["steps"]


class CallbackStates(Callback):
    """Every callback's state right after a restore (on_train_start)."""

    def __init__(self) -> None:
        self.at_start: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.at_start = {cb.state_key: copy.deepcopy(cb.state_dict()) for cb in trainer.callbacks if cb is not self}


def trainer(dirpath, epochs, io=None, *, save_last=True, top_k=-1, monitor="val_loss", callbacks=(), precision=None):
    checkpointing = ModelCheckpoint(dirpath=dirpath, filename="{epoch}", monitor=monitor, save_top_k=top_k,
                                    mode="max" if monitor == "step" else "min", save_last=save_last)
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0,
                     plugins=[io if io is not None else BCPCheckpointIO(), *([precision] if precision else [])],
                     callbacks=[checkpointing, EarlyStopping("val_loss", patience=100), *callbacks])


def assert_same(expected, actual, where="checkpoint") -> None:
    """Deep equality; tensors bitwise (same dtype and shape)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and expected.dtype == actual.dtype, where
        assert expected.shape == actual.shape and torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(expected) == list(actual), (where, list(expected), list(actual))
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{where}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, (where, expected, actual)


def test_everything_lightning_keeps_survives_and_training_resumes(tmp_path):
    io = RecordingIO()
    first = trainer(tmp_path, 2, io, precision=CountingPrecision())
    first.fit(LitMLP(lr=3e-2), datamodule=Data(shuffle=False))
    last = str(tmp_path / "last.ckpt")

    loaded = BCPCheckpointIO().load_checkpoint(last)
    saved = io.saved[last]
    assert set(saved) >= {"epoch", "global_step", "loops", "callbacks", "optimizer_states", "lr_schedulers",
                          "CountingPrecision", "hyper_parameters", "Data", "state_dict"}
    # The saved dict and the loaded one are equal; only entry order may differ.
    assert_same({k: saved[k] for k in sorted(saved)}, {k: loaded[k] for k in sorted(loaded)})

    # Resuming (through "last") continues exactly like a run that never stopped. The model is built
    # with another learning rate: the optimizer's and scheduler's come from the checkpoint.
    callback_states = CallbackStates()
    resumed = trainer(tmp_path, 4, precision=CountingPrecision(), callbacks=[callback_states])
    resumed_data = Data(shuffle=False)
    resumed.fit(LitMLP(lr=1.0), datamodule=resumed_data, ckpt_path="last")
    uninterrupted = trainer(tmp_path / "uninterrupted", 4)
    uninterrupted.fit(LitMLP(lr=3e-2), datamodule=Data(shuffle=False))

    assert resumed.global_step == uninterrupted.global_step == 48
    assert resumed.precision_plugin.steps == 48 and resumed_data.loaders_made == 2
    early_stopping = resumed.early_stopping_callback.state_key
    assert_same(saved["callbacks"][early_stopping], callback_states.at_start[early_stopping])
    model_checkpoint = callback_states.at_start[resumed.checkpoint_callback.state_key]
    assert model_checkpoint["last_model_path"] == last and len(model_checkpoint["best_k_models"]) == 2
    assert_bitwise(full_state(uninterrupted), full_state(resumed))


def test_model_checkpoint_top_k_last_and_link(tmp_path):
    first = trainer(tmp_path, 3, save_last="link")
    first.fit(LitMLP(), datamodule=Data(shuffle=False))
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=2.ckpt"
    linked = BCPCheckpointIO().load_checkpoint(tmp_path / "epoch=2.ckpt")

    # Resuming through the link, then saving last.ckpt for real: the link is replaced, and the
    # checkpoint it pointed to stays as it was (no new generation written through the link).
    second = trainer(tmp_path, 4, save_last=True)
    second.fit(LitMLP(), datamodule=Data(shuffle=False), ckpt_path="last")
    assert second.global_step == 48 and linked["global_step"] == 36
    assert not os.path.islink(tmp_path / "last.ckpt")
    assert sorted(os.listdir(tmp_path / "epoch=2.ckpt")) == [METRICS_DIR, "gen-00000001"]
    assert_same(linked, BCPCheckpointIO().load_checkpoint(tmp_path / "epoch=2.ckpt"))

    # Top-k removal goes through the plugin; last.ckpt is rewritten at the same path, each save a
    # new generation; once it is committed, the two newest stay (bcp's default retention).
    third = trainer(tmp_path / "top1", 3, top_k=1, monitor="step", save_last=True)
    third.fit(LitMLP(), datamodule=Data(shuffle=False))
    assert sorted(os.listdir(tmp_path / "top1")) == ["epoch=2.ckpt", "last.ckpt"]
    assert sorted(os.listdir(tmp_path / "top1" / "last.ckpt")) == [METRICS_DIR, "gen-00000002", "gen-00000003"]


def test_trainer_save_checkpoint_and_weights_only(tmp_path):
    run = trainer(tmp_path, 1, save_last=False)
    run.fit(LitMLP(), datamodule=Data(shuffle=False))
    run.save_checkpoint(tmp_path / "full.ckpt")
    run.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    full = BCPCheckpointIO().load_checkpoint(tmp_path / "full.ckpt")
    weights = BCPCheckpointIO().load_checkpoint(tmp_path / "weights.ckpt")
    assert "optimizer_states" in full and "optimizer_states" not in weights and "lr_schedulers" not in weights
    assert_same(full["state_dict"], weights["state_dict"])

    # A weights-only checkpoint is for evaluation: validate() loads it through the plugin.
    evaluator = trainer(tmp_path / "eval", 1)
    model = LitMLP()
    evaluator.validate(model, datamodule=Data(shuffle=False), ckpt_path=tmp_path / "weights.ckpt", verbose=False)
    assert_same(weights["state_dict"], {k: v for k, v in model.state_dict().items()})


def test_plain_bcp_load_reads_a_plugin_checkpoint(tmp_path):
    run = trainer(tmp_path, 1)
    run.fit(LitMLP(), datamodule=Data(shuffle=False))
    model = LitMLP()
    state = {"model": model, "lightning": None}
    bcp.load(tmp_path / "last.ckpt", state)
    assert_same(run.lightning_module.state_dict(), model.state_dict())
    assert state["lightning"]["global_step"] == run.global_step == 12


@dataclasses.dataclass
class Settings:
    width: int = 3


def test_values_outside_the_safe_encoding(tmp_path):
    with pytest.raises(bcp.UnsupportedValueError, match="allow_pickle=True"):
        trainer(tmp_path / "safe", 1).fit(LitMLP(layout=Settings()), datamodule=Data(shuffle=False))

    trainer(tmp_path / "pickled", 1, BCPCheckpointIO(allow_pickle=True)).fit(
        LitMLP(layout=Settings()), datamodule=Data(shuffle=False))
    path = tmp_path / "pickled" / "last.ckpt"
    with pytest.raises(bcp.UnsafeCheckpointError):
        BCPCheckpointIO().load_checkpoint(path)
    assert BCPCheckpointIO(allow_pickle=True).load_checkpoint(path)["hyper_parameters"]["layout"] == Settings()
    with pytest.raises(bcp.UnsafeCheckpointError):  # weights_only=True never unpickles
        BCPCheckpointIO(allow_pickle=True).load_checkpoint(path, weights_only=True)


def test_checkpoints_in_other_formats_are_refused_with_the_way_out(tmp_path):
    # (Lightning's single-file checkpoints load: test_lightning_checkpoint_api.py.)
    sharded = tmp_path / "sharded.ckpt"
    sharded.mkdir()
    torch.save({}, sharded / "meta.pt")
    with pytest.raises(bcp.CheckpointNotFoundError, match="Lightning's own sharded format"):
        BCPCheckpointIO().load_checkpoint(sharded)
    # Only a strategy that bypassed the plugin leaves those for it to remove.
    with pytest.raises(bcp.CheckpointError, match="BCPModelParallelStrategy"):
        BCPCheckpointIO().remove_checkpoint(sharded)

    model = LitMLP()
    bcp.save(tmp_path / "plain", {"model": model})
    with pytest.raises(bcp.CheckpointError, match="not a Lightning checkpoint saved by bcp_lightning"):
        BCPCheckpointIO().load_checkpoint(tmp_path / "plain")


def test_misuse_of_the_plugin_and_strategies(tmp_path):
    io = BCPCheckpointIO()
    io.save_checkpoint({"epoch": 0}, tmp_path / "x.ckpt")
    with pytest.raises(TypeError, match="map_location"):
        io.load_checkpoint(tmp_path / "x.ckpt", map_location="cpu")
    assert io.load_checkpoint(tmp_path / "x.ckpt") == {"epoch": 0}

    with pytest.raises(TypeError, match="needs a BCPCheckpointIO"):
        L.Trainer(accelerator="cpu", devices=1, strategy=BCPDDPStrategy(), plugins=[TorchCheckpointIO()])


def test_async_save(tmp_path):
    io = RecordingIO(async_save=True)
    run = trainer(tmp_path, 3, io, top_k=1, monitor="step")
    run.fit(LitMLP(), datamodule=Data(shuffle=False))
    # Top-k removal waited for the removed path's save; teardown waited for the rest.
    assert sorted(os.listdir(tmp_path)) == ["epoch=2.ckpt", "last.ckpt"]
    last = str(tmp_path / "last.ckpt")
    saved = io.saved[last]
    loaded = BCPCheckpointIO().load_checkpoint(last)
    assert_same({k: saved[k] for k in sorted(saved)}, {k: loaded[k] for k in sorted(loaded)})
    resumed = trainer(tmp_path, 4, BCPCheckpointIO(async_save=True))
    resumed.fit(LitMLP(), datamodule=Data(shuffle=False), ckpt_path="last")
    assert resumed.global_step == 48


def test_pytorch_lightning_import_path(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from bcp_lightning.pytorch_lightning import BCPCheckpointIO as PLCheckpointIO

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)), batch_size=4)

    def pl_trainer(epochs):
        return pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, plugins=[PLCheckpointIO()], default_root_dir=tmp_path)

    first = pl_trainer(1)
    first.fit(Tiny(), data)
    path = tmp_path / "checkpoints" / "epoch=0-step=2.ckpt"
    assert (path / "gen-00000001").is_dir()
    resumed = pl_trainer(2)
    resumed.fit(Tiny(), data, ckpt_path=path)
    assert resumed.global_step == 4


def test_several_optimizers_are_merged_by_parameter_name_and_split_back(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = LitMLP()
    first = torch.optim.AdamW(model.net.fc1.parameters(), lr=0.1)
    second = torch.optim.SGD([{"params": model.net.fc2.parameters()}, {"params": model.net.norm.parameters(),
                                                                       "lr": 0.5}], lr=0.2, momentum=0.9)
    model.net(torch.randn(4, 12)).sum().backward()
    first.step()
    second.step()
    checkpoint = {"epoch": 3, "state_dict": model.state_dict(),
                  "optimizer_states": [get_optimizer_state_dict(model, o) for o in (first, second)]}
    # As bcp_lightning's strategies give them: FQN-keyed, so saved resharding-ready.
    BCPCheckpointIO().save_checkpoint(checkpoint, tmp_path / "two.ckpt")
    loaded = BCPCheckpointIO().load_checkpoint(tmp_path / "two.ckpt")
    # Loaded back as Lightning's own strategies expect them: per optimizer, keyed by index.
    assert_same(first.state_dict(), loaded["optimizer_states"][0])
    assert_same(second.state_dict(), loaded["optimizer_states"][1])

    shared = torch.optim.SGD(model.net.fc1.parameters(), lr=0.1)
    checkpoint["optimizer_states"].append(get_optimizer_state_dict(model, shared))
    with pytest.raises(bcp.CheckpointError, match="is in optimizers 0 and 2"):
        BCPCheckpointIO().save_checkpoint(checkpoint, tmp_path / "shared.ckpt")
