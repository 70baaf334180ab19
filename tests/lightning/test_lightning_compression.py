"""``BCPCheckpointIO(compression="zstd")`` (or ``storage_options={"compression": ...}`` for one save):
a real Trainer's checkpoint is compressed (format version 4, fewer bytes stored than held) and a fit
resumed from it restores the model and AdamW state bitwise, through a plugin that does not compress."""

from __future__ import annotations

import lightning as L
import pytest
import torch

import bcp
from bcp_lightning import BCPCheckpointIO
from compressed import assert_compressed, stored_and_raw
from lightning_worker import Data, LitMLP, Recorder
from models import assert_bitwise

SAVED_AT = 3


def _trainer(plugin: BCPCheckpointIO, recorder: Recorder, max_steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, plugins=[plugin], logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     num_sanity_val_steps=0, callbacks=[recorder])


class LitMLPWithMask(LitMLP):
    """LitMLP whose checkpoint also holds a tensor that compresses (a mask of zeros, added by its
    ``on_save_checkpoint``): the MLP's tensors hold a few hundred values each, too few for any codec
    to shrink."""

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["mask"] = torch.zeros(4096)


def test_a_compressed_checkpoint_resumes_bitwise(tmp_path):
    path = str(tmp_path / "last.ckpt")
    saving = Recorder(resumed=False)
    trainer = _trainer(BCPCheckpointIO(compression="zstd"), saving, SAVED_AT)
    trainer.fit(LitMLPWithMask(), datamodule=Data(stateful=True))
    trainer.save_checkpoint(path)
    assert_compressed(path)
    resuming = Recorder(resumed=True)
    _trainer(BCPCheckpointIO(), resuming, SAVED_AT + 1).fit(LitMLP(), datamodule=Data(stateful=True), ckpt_path=path)
    assert resuming.restored["global_step"] == SAVED_AT
    assert_bitwise(saving.saved[SAVED_AT], resuming.restored["state"])


def test_storage_options_compress_one_save_and_refuse_an_unknown_codec(tmp_path):
    trainer = _trainer(BCPCheckpointIO(), Recorder(resumed=False), 1)
    trainer.fit(LitMLP(), datamodule=Data(stateful=True))
    trainer.save_checkpoint(tmp_path / "plain")
    trainer.save_checkpoint(tmp_path / "compressed", storage_options={"compression": "zstd"})
    assert_compressed(tmp_path / "compressed")
    stored, raw = stored_and_raw(tmp_path / "plain")
    assert stored == raw
    with pytest.raises(bcp.CheckpointError, match="compression"):
        trainer.save_checkpoint(tmp_path / "refused", storage_options={"compression": 3})
