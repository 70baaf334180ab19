"""``BCPCheckpointIO(keep_generations=N)``: a checkpoint path saved again (``last.ckpt``) keeps its N
newest committed generations, and an older one loads with ``bcp.load(..., generation=)`` or, for a
Trainer resume, with ``BCPCheckpointIO(load_generation=)``."""

from __future__ import annotations

import pytest
import torch

import bcp
from bcp.integration import checkpoint_location, open_checkpoint
from bcp_lightning import BCPCheckpointIO
from lightning_launch import run
from models import assert_bitwise


def test_the_plugin_keeps_the_generations_asked_for(tmp_path):
    path = str(tmp_path / "last.ckpt")
    plugin = BCPCheckpointIO(keep_generations=2)
    for step in range(3):
        plugin.save_checkpoint({"state_dict": {"w": torch.full((3,), float(step))}, "global_step": step}, path)
    kept = checkpoint_location(path, None).generations()
    assert len(kept) == 2
    # Each generation records Lightning's global_step.
    assert [open_checkpoint(path, generation=g).manifest.step for g in kept] == [1, 2]
    state = {"model": {"w": torch.zeros(3)}}
    bcp.load(path, state, generation=kept[0], strict=False)
    assert torch.equal(state["model"]["w"], torch.full((3,), 1.0))


def test_a_single_file_checkpoint_has_no_generation_to_load(tmp_path):
    path = str(tmp_path / "torch.ckpt")
    torch.save({"state_dict": {"w": torch.zeros(3)}}, path)
    with pytest.raises(bcp.CheckpointNotFoundError, match="load_generation=1 .* keeps none"):
        BCPCheckpointIO(load_generation=1).load_checkpoint(path)


STEPS_PER_EPOCH = 6  # 48 samples, batches of 4 on each of 2 ranks


def fit(strategy: str, dirpath: str, **args) -> dict:
    return {"case": "fit", "args": {"strategy": strategy, "dirpath": dirpath, "epochs": 3, **args}}


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["bcp_ddp", "ddp"])
def test_a_trainer_resumes_from_an_older_kept_generation(tmp_path, strategy):
    """Three epochs save ``last.ckpt`` three times, keeping two generations; a Trainer whose plugin
    has ``load_generation`` resumes from the older one (after epoch 1), bitwise, and its epoch 2
    repeats the first run's losses."""
    r = str(tmp_path)
    last = f"{r}/run/last.ckpt"
    cases = [fit(strategy, f"{r}/run", keep_generations=2),
             fit(strategy, f"{r}/rolled_back", load_generation=2, resume_from=last)]
    for reference, rolled_back in run(2, cases, f"{r}/launch"):
        step = 2 * STEPS_PER_EPOCH
        assert rolled_back["restored"]["global_step"] == step
        assert_bitwise(reference["saved"][step], rolled_back["restored"]["state"])
        assert min(rolled_back["losses"]) == step + 1
        assert rolled_back["losses"] == {s: reference["losses"][s] for s in rolled_back["losses"]}
    assert checkpoint_location(last, None).generations() == [2, 3]


@pytest.mark.parametrize("how", ["plugin", "storage_options"])
def test_incremental_saves_of_last_ckpt_write_only_what_changed(tmp_path, how):
    path = str(tmp_path / "last.ckpt")
    plugin = BCPCheckpointIO(keep_generations=1, incremental=how == "plugin")
    overrides = {"incremental": True} if how == "storage_options" else None
    frozen = torch.arange(300_000, dtype=torch.float32)
    for step in range(3):
        checkpoint = {"state_dict": {"frozen": frozen, "head": torch.full((3,), float(step))}, "global_step": step}
        plugin.save_checkpoint(checkpoint, path, storage_options=overrides)
    newest = open_checkpoint(path).manifest
    assert newest.version == 3 and newest.earlier_generations() == {1}  # the frozen tensor's bytes stay in 1
    assert checkpoint_location(path, None).generations() == [1, 3]
    state = {"model": {"frozen": torch.zeros(300_000), "head": torch.zeros(3)}}
    bcp.load(path, state, strict=False)
    assert torch.equal(state["model"]["frozen"], frozen) and torch.equal(state["model"]["head"], torch.full((3,), 2.0))
