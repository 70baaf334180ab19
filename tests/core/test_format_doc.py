"""The "read a tensor by hand" recipe of docs/format.md works on a real checkpoint."""

from __future__ import annotations

import numpy as np
import torch

import bcp
from doc_blocks import block_covered_by
from models import MLP


def test_reading_a_tensor_by_hand_as_documented(tmp_path, monkeypatch):
    recipe = block_covered_by("tests/core/test_format_doc.py", "test_reading_a_tensor_by_hand_as_documented")
    model = MLP()
    monkeypatch.chdir(tmp_path)
    for _ in range(3):  # the recipe reads generation 3
        bcp.save("ckpt", {"model": model})
    scope: dict = {}
    exec(compile(recipe.code, recipe.id, "exec"), scope)
    assert np.array_equal(scope["out"], model.fc1.weight.detach().numpy())
    assert torch.equal(torch.from_numpy(scope["out"]), model.fc1.weight.detach())
