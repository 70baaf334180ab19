"""Kept generations load: ``bcp.load(..., generation=N)`` rolls back to an older committed one."""

from __future__ import annotations

import pytest
import torch

import bcp
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
