"""Lightning's own checkpoint API around BCPCheckpointIO, with real single-device Trainers:
``Trainer.save_checkpoint(..., storage_options=...)``, resuming the ``.ckpt`` file a run wrote
with Lightning's default TorchCheckpointIO (and refusing a hostile one), and Lightning's
``AsyncCheckpointIO`` wrapper around the plugin."""

from __future__ import annotations

import dataclasses
import os
import threading

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins import AsyncCheckpointIO, TorchCheckpointIO

import bcp
from bcp_lightning import BCPCheckpointIO
from lightning_worker import Data, LitMLP, Recorder, full_state
from models import assert_bitwise

STEPS_PER_EPOCH = 12


def trainer(dirpath, epochs, io, *, top_k=-1, monitor="val_loss", callbacks=()) -> L.Trainer:
    checkpointing = ModelCheckpoint(dirpath=dirpath, filename="{epoch}", monitor=monitor, save_top_k=top_k,
                                    mode="max" if monitor == "step" else "min", save_last=True)
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, plugins=[io],
                     callbacks=[checkpointing, *callbacks])


def uninterrupted(tmp_path, epochs: int = 4) -> tuple[L.Trainer, Recorder]:
    recorder = Recorder(resumed=False)
    run = trainer(tmp_path / "uninterrupted", epochs, BCPCheckpointIO(), callbacks=[recorder])
    run.fit(LitMLP(lr=3e-2), datamodule=Data(shuffle=False))
    return run, recorder


# storage_options


@dataclasses.dataclass
class Settings:
    width: int = 3


def test_storage_options_override_the_plugin_options_for_one_save(tmp_path):
    run = trainer(tmp_path, 1, BCPCheckpointIO(), top_k=0)
    run.fit(LitMLP(), datamodule=Data(shuffle=False))
    run.lightning_module.hparams.layout = Settings()  # outside the safe encoding: only allow_pickle saves it

    with pytest.raises(bcp.UnsupportedValueError, match="allow_pickle=True"):
        run.save_checkpoint(tmp_path / "refused.ckpt")
    run.save_checkpoint(tmp_path / "pickled.ckpt", storage_options={"allow_pickle": True, "io_threads": 1,
                                                                    "async_save": True, "verify_replicas": True})
    run.strategy.checkpoint_io.teardown()
    loaded = BCPCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "pickled.ckpt")
    assert loaded["hyper_parameters"]["layout"] == Settings() and loaded["global_step"] == STEPS_PER_EPOCH

    with pytest.raises(bcp.CheckpointError, match=r"'region' is not understood; bcp_lightning honours \['allow_pickle'"):
        run.save_checkpoint(tmp_path / "x.ckpt", storage_options={"region": "eu"})
    with pytest.raises(bcp.CheckpointError, match=r"storage_options\['io_threads'\] must be a positive int"):
        run.save_checkpoint(tmp_path / "x.ckpt", storage_options={"io_threads": 0})
    with pytest.raises(bcp.CheckpointError, match="storage_options must be a dict"):
        run.save_checkpoint(tmp_path / "x.ckpt", storage_options="s3")
    assert not (tmp_path / "x.ckpt").exists()


# Switching a run to bcp


def test_a_run_switches_to_bcp_by_resuming_its_torch_checkpoint(tmp_path):
    first = trainer(tmp_path, 2, TorchCheckpointIO())
    first.fit(LitMLP(lr=3e-2), datamodule=Data(shuffle=False))
    assert (tmp_path / "last.ckpt").is_file()

    # The model is built with another learning rate: the optimizer's comes from the torch file.
    recorder = Recorder(resumed=True)
    resumed = trainer(tmp_path, 4, BCPCheckpointIO(), callbacks=[recorder])
    resumed.fit(LitMLP(lr=1.0), datamodule=Data(shuffle=False), ckpt_path=tmp_path / "last.ckpt")
    reference, reference_recorder = uninterrupted(tmp_path)

    assert recorder.restored["global_step"] == 2 * STEPS_PER_EPOCH
    assert recorder.losses == {s: v for s, v in reference_recorder.losses.items() if s > 2 * STEPS_PER_EPOCH}
    assert_bitwise(full_state(reference), full_state(resumed))
    # Later saves went through bcp: last.ckpt (a file before) is now a bcp checkpoint directory.
    assert (tmp_path / "epoch=1.ckpt").is_file() and (tmp_path / "epoch=3.ckpt").is_dir()
    assert (tmp_path / "last.ckpt").is_dir()
    assert BCPCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 4 * STEPS_PER_EPOCH


class Payload:
    """Unpickling this object creates ``marker``: what a hostile checkpoint does instead."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_hostile_torch_checkpoint_is_refused_without_running_it(tmp_path):
    import torch

    marker = tmp_path / "payload-ran"
    path = tmp_path / "hostile.ckpt"
    torch.save({"epoch": 0, "global_step": 0, "state_dict": LitMLP().state_dict(), "extra": Payload(str(marker))},
               path)
    for io in (BCPCheckpointIO(), BCPCheckpointIO(allow_pickle=True)):
        with pytest.raises(bcp.UnsafeCheckpointError, match=r"weights_only=True\) refused .*GLOBAL io.open"):
            io.load_checkpoint(path)
    with pytest.raises(bcp.UnsafeCheckpointError):
        trainer(tmp_path / "run", 1, BCPCheckpointIO()).fit(LitMLP(), datamodule=Data(shuffle=False), ckpt_path=path)
    assert not marker.exists()

    # Damaged files and other objects are refused clearly as well.
    intact = path.read_bytes()
    path.write_bytes(intact[: len(intact) // 2])
    with pytest.raises(bcp.CorruptCheckpointError, match="not a readable torch.save checkpoint"):
        BCPCheckpointIO().load_checkpoint(path)
    torch.save([1, 2], path)
    with pytest.raises(bcp.CheckpointError, match="holds a list, not a Lightning checkpoint dict"):
        BCPCheckpointIO().load_checkpoint(path)


# Lightning's AsyncCheckpointIO wrapper


class Gate:
    """A value whose pickling, inside bcp's save on the wrapper's thread, waits until ``release``
    is set: the save is then running while training goes on, as on a slow disk."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __reduce__(self):
        self.entered.set()
        # Released from another thread: the training thread may be waiting for this very save.
        threading.Timer(2.0, self.release.set).start()
        self.release.wait()
        return Gate, ()


class HoldFirstSave(Callback):
    """Holds the first checkpoint's save (see Gate); the next epoch starts once that save runs, so
    ModelCheckpoint removes that checkpoint while it is being written."""

    def __init__(self) -> None:
        self.gate = Gate()
        self.used = False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if not self.used:
            checkpoint["gate"] = self.gate
            self.used = True

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1:
            assert self.gate.entered.wait(timeout=60)


def test_lightnings_async_wrapper_around_the_plugin(tmp_path):
    def wrapped() -> AsyncCheckpointIO:
        return AsyncCheckpointIO(BCPCheckpointIO(allow_pickle=True))

    recorder = Recorder(resumed=False)
    first = trainer(tmp_path, 2, wrapped(), top_k=1, monitor="step", callbacks=[HoldFirstSave(), recorder])
    first.fit(LitMLP(lr=3e-2), datamodule=Data(shuffle=False))
    # epoch=0.ckpt was removed once its save had finished, not from under it (nor before it).
    assert sorted(os.listdir(tmp_path)) == ["epoch=1.ckpt", "last.ckpt"]

    resumed_recorder = Recorder(resumed=True)
    resumed = trainer(tmp_path, 4, wrapped(), callbacks=[resumed_recorder])
    resumed.fit(LitMLP(lr=3e-2), datamodule=Data(shuffle=False), ckpt_path="last")
    reference, reference_recorder = uninterrupted(tmp_path)
    assert recorder.losses == {s: v for s, v in reference_recorder.losses.items() if s <= 2 * STEPS_PER_EPOCH}
    assert resumed_recorder.losses == {s: v for s, v in reference_recorder.losses.items() if s > 2 * STEPS_PER_EPOCH}
    assert_bitwise(full_state(reference), full_state(resumed))
    assert BCPCheckpointIO().load_checkpoint(tmp_path / "epoch=3.ckpt")["global_step"] == 4 * STEPS_PER_EPOCH
