"""Kept generations load: ``bcp.load(..., generation=N)`` rolls back to an older committed one."""

from __future__ import annotations

import pytest
import torch

import bcp
from bcp.integration import checkpoint_location, open_checkpoint
from models import build, train


def test_an_older_kept_generation_loads_bitwise(tmp_path):
    path = str(tmp_path / "ckpt")
    model, optimizer = build("plain", seed=1)
    snapshots = {}
    for _ in range(3):
        train(model, optimizer, range(1))
        handle = bcp.save(path, {"model": model, "optimizer": optimizer}, keep_generations=2)
        snapshots[handle.generation] = {k: v.clone() for k, v in model.state_dict().items()}
    older = sorted(snapshots)[1]
    fresh, fresh_optimizer = build("plain", seed=2)
    result = bcp.load(path, {"model": fresh, "optimizer": fresh_optimizer}, generation=older)
    assert result.generation == older
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in snapshots[older].items())
    first = sorted(snapshots)[0]  # removed: keep_generations=2
    with pytest.raises(bcp.CheckpointNotFoundError, match=rf"no generation {first} .*kept are \[{older}, {older + 1}\]"):
        bcp.load(path, {"model": fresh}, generation=first)


def test_each_generation_records_the_step_it_was_saved_at(tmp_path):
    path = str(tmp_path / "ckpt")
    model, optimizer = build("plain", seed=1)
    for step in (10, 20):
        bcp.save(path, {"model": model, "optimizer": optimizer}, step=step, keep_generations=3)
    bcp.save(path, {"model": model}, keep_generations=3)  # a save that does not say
    location = checkpoint_location(path, None)
    steps = [open_checkpoint(path, generation=g).manifest.step for g in location.generations()]
    assert steps == [10, 20, None]


@pytest.mark.parametrize("step", [-1, 1.5, True, "3"])
def test_a_step_that_is_not_a_training_step_is_refused(tmp_path, step):
    with pytest.raises(bcp.CheckpointError, match="step must be a non-negative int"):
        bcp.save(str(tmp_path / "ckpt"), {"model": torch.nn.Linear(2, 2)}, step=step)
