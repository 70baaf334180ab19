"""``BCPCheckpointIO(keep_generations=N)``: a checkpoint path saved again (``last.ckpt``) keeps its N
newest committed generations, and an older one loads with ``bcp.load(..., generation=)``."""

from __future__ import annotations

import torch

import bcp
from bcp.integration import checkpoint_location
from bcp_lightning import BCPCheckpointIO


def test_the_plugin_keeps_the_generations_asked_for(tmp_path):
    path = str(tmp_path / "last.ckpt")
    plugin = BCPCheckpointIO(keep_generations=2)
    for step in range(3):
        plugin.save_checkpoint({"state_dict": {"w": torch.full((3,), float(step))}, "global_step": step}, path)
    kept = checkpoint_location(path, None).generations()
    assert len(kept) == 2
    state = {"model": {"w": torch.zeros(3)}}
    bcp.load(path, state, generation=kept[0], strict=False)
    assert torch.equal(state["model"]["w"], torch.full((3,), 1.0))
