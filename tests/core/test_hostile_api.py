"""Bad arguments get a ``CheckpointError`` that says what is wrong.

Guards past defects where they passed silently or failed obscurely: loading into a model on the meta
device reported success and loaded nothing, ``bcp.save("", state)`` wrote into the current
directory, and an optimizer holding a parameter the model lacks failed with a ``KeyError`` naming an
object id instead of the parameter."""

from __future__ import annotations

import os

import pytest
import torch

import bcp


def test_an_empty_path_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = {"model": {"w": torch.ones(3)}}
    for call in (lambda: bcp.save("", state), lambda: bcp.load("", state), lambda: bcp.save(" ", state)):
        with pytest.raises(bcp.CheckpointError, match="empty checkpoint path"):
            call()
    assert os.listdir(tmp_path) == []


def test_loading_into_a_model_on_the_meta_device_fails_instead_of_loading_nothing(tmp_path):
    bcp.save(tmp_path, {"model": torch.nn.Linear(4, 3)})
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    with pytest.raises(bcp.MismatchError, match=r"meta device.*model/weight"):
        bcp.load(tmp_path, {"model": model})


def test_an_optimizer_holding_a_parameter_the_model_lacks_is_named(tmp_path):
    model = torch.nn.Linear(4, 3)
    stray = torch.nn.Parameter(torch.ones(5, 2))
    optimizer = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [stray]}], lr=0.1)
    with pytest.raises(bcp.AdapterError, match=r"param group 1 holds a parameter \(index 0, shape \[5, 2\]") as caught:
        bcp.save(tmp_path, {"model": model, "optimizer": optimizer})
    assert "optimizer" in str(caught.value)
    bcp.save(tmp_path, {"model": model})
    with pytest.raises(bcp.AdapterError, match="not a parameter of the model"):
        bcp.load(tmp_path, {"model": model, "optimizer": optimizer})
