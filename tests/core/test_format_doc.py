"""The "read a tensor by hand" recipe of docs/format.md works on a real checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

import bcp
from models import MLP

DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def test_reading_a_tensor_by_hand_as_documented(tmp_path, monkeypatch):
    recipe = re.search(r"## Reading a tensor by hand\s+```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    model = MLP()
    monkeypatch.chdir(tmp_path)
    for _ in range(3):  # the recipe reads generation 3
        bcp.save("ckpt", {"model": model})
    scope: dict = {}
    exec(compile(recipe, str(DOC), "exec"), scope)
    assert np.array_equal(scope["out"], model.fc1.weight.detach().numpy())
    assert torch.equal(torch.from_numpy(scope["out"]), model.fc1.weight.detach())
