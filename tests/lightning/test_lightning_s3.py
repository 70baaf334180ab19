"""A Lightning run checkpointing to ``s3://`` (a real SeaweedFS) through BCPCheckpointIO, resumed
from the s3 URL with losses identical to an uninterrupted run."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from bcp.storage import storage_for
from bcp_lightning import BCPCheckpointIO
from lightning_worker import Data, LitMLP, Recorder, full_state
from models import assert_bitwise

STEPS_PER_EPOCH = 12


def trainer(root: str, epochs: int, recorder: Recorder, *, top_k: int = -1) -> L.Trainer:
    checkpointing = ModelCheckpoint(filename="{epoch}", save_top_k=top_k, monitor="step",
                                    mode="max", save_last=True)
    return L.Trainer(default_root_dir=root, accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     plugins=[BCPCheckpointIO()], callbacks=[checkpointing, recorder])


def test_a_run_resumes_from_its_s3_checkpoint_with_identical_losses(s3_env, s3_url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a URL mistaken for a relative path would show up here
    reference = Recorder(resumed=False)
    uninterrupted = trainer(str(tmp_path / "reference"), 4, reference)
    uninterrupted.fit(LitMLP(lr=3e-2), datamodule=Data(shuffle=False))

    first = trainer(s3_url, 2, Recorder(resumed=False), top_k=1)
    first.fit(LitMLP(lr=3e-2), datamodule=Data(shuffle=False))
    saved = f"{s3_url}/checkpoints/epoch=1.ckpt"
    assert first.checkpoint_callback.best_model_path == saved
    # top-k removed epoch=0's checkpoint from the bucket (through the plugin's remove_checkpoint)
    assert storage_for(f"{s3_url}/checkpoints").list_dir("") == ["epoch=1.ckpt", "last.ckpt"]
    assert storage_for(saved).exists("gen-00000001/COMMITTED")  # a committed bcp checkpoint in the bucket

    recorder = Recorder(resumed=True)
    resumed = trainer(s3_url, 4, recorder)
    resumed.fit(LitMLP(lr=1.0), datamodule=Data(shuffle=False), ckpt_path=saved)
    assert recorder.restored["global_step"] == 2 * STEPS_PER_EPOCH
    assert recorder.losses == {s: v for s, v in reference.losses.items() if s > 2 * STEPS_PER_EPOCH}
    assert_bitwise(full_state(uninterrupted), full_state(resumed))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference"]
