"""A load whose names do not match the checkpoint's answers with the fix: both sides listed (what
is missing, what the checkpoint holds that nothing asked for), the closest saved names, and
``strict=False`` offered only where it would load something; a non-strict load that matches
nothing warns instead of succeeding silently."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

import bcp


def _saved(tmp_path, layers: int = 2) -> tuple[str, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "ckpt")
    bcp.save(path, {"model": model, "optimizer": optimizer})
    return path, model


def _mismatch(path: str, state: dict) -> str:
    with pytest.raises(bcp.MismatchError) as raised:
        bcp.load(path, state)
    assert isinstance(raised.value, bcp.CheckpointError) and raised.value.path == path
    return str(raised.value)


def test_a_misspelt_component_is_answered_with_the_saved_one(tmp_path):
    path, model = _saved(tmp_path)
    message = _mismatch(path, {"modle": model})
    assert "missing from the checkpoint: modle/0.bias, modle/0.weight, modle/1.bias, modle/1.weight" in message
    assert ("in components the state does not ask for: model/0.bias, model/0.weight, model/1.bias, model/1.weight, "
            "optimizer/param_groups") in message
    assert "did you mean 'model' for 'modle'?" in message
    assert "strict=False would load nothing" in message and "pass strict=False" not in message


def test_strict_false_is_offered_where_it_loads_something(tmp_path):
    path, model = _saved(tmp_path)
    message = _mismatch(path, {"model": model, "optimiser": torch.optim.SGD(model.parameters(), lr=0.1)})
    assert "did you mean 'optimizer' for 'optimiser'?" in message
    assert "pass strict=False to load what matches (4 entries)" in message


def test_a_misspelt_entry_is_answered_with_the_closest_saved_entry(tmp_path):
    path, _ = _saved(tmp_path)
    live = {"0.weight": torch.zeros(3, 3), "0.bais": torch.zeros(3), "1.weight": torch.zeros(3, 3),
            "1.bias": torch.zeros(3)}
    message = _mismatch(path, {"model": live})
    assert re.search(r"missing from the checkpoint: model/0\.bais; in the checkpoint but not wanted on this rank: "
                     r"model/0\.bias;", message)
    assert "did you mean 'model/0.bias' for 'model/0.bais'?" in message
    assert "pass strict=False to load what matches (3 entries)" in message


def test_a_non_strict_load_that_matches_nothing_warns(tmp_path, caplog):
    path, model = _saved(tmp_path)
    with caplog.at_level(logging.WARNING, logger="bcp"):
        result = bcp.load(path, {"modle": model}, strict=False)
    assert result.loaded == []
    warned = [r.getMessage() for r in caplog.records if "nothing is loaded" in r.getMessage()]
    assert len(warned) == 1 and "did you mean 'model' for 'modle'?" in warned[0] and path in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bcp"):
        bcp.load(path, {"model": model}, strict=False)  # loads: no warning
    assert not caplog.records


def test_thousands_of_names_are_counted_not_listed(tmp_path):
    path, model = _saved(tmp_path, layers=600)
    message = _mismatch(path, {"modle": model})
    assert "missing from the checkpoint: all 1200 entries of component 'modle'" in message
    assert "model (1200 entries: model/0.bias, model/0.weight, model/1.bias, ...)" in message
    assert len(message) < 600
