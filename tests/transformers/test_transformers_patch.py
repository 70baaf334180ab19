"""Where bcp_transformers reaches into the Trainer beyond its public API (``transformers_patch``):
this test fails when a transformers upgrade moves or reshapes a method the switch replaces."""

from __future__ import annotations

import importlib.metadata
import inspect

import pytest
from transformers import Trainer

import bcp_transformers
from bcp import AdapterError
from bcp.integration import MovedNameError
from bcp_transformers import transformers_patch


def test_the_installed_transformers_is_one_bcp_transformers_routes():
    version = tuple(int(p) for p in importlib.metadata.version("transformers").split(".")[:2])
    assert transformers_patch.TESTED[0] <= version < transformers_patch.TESTED[1]
    assert transformers_patch.why_not() is None


def test_every_routed_method_is_the_trainers_own_under_that_name_and_dispatches():
    for name in transformers_patch.ROUTED:
        method = getattr(Trainer, name)
        assert getattr(method, transformers_patch.ROUTED_MARK, False), name
        assert method.__wrapped__.__name__ == name and callable(method.__wrapped__)


def test_the_parameters_the_engine_passes_by_name_exist():
    parameters = {name: inspect.signature(getattr(Trainer, name).__wrapped__).parameters
                  for name in transformers_patch.ROUTED}
    assert "resume_from_checkpoint" in parameters["train"]
    assert {"output_dir", "_internal_call"} <= set(parameters["save_model"])
    assert {"max_steps", "num_update_steps_per_epoch", "num_train_epochs"} <= set(parameters["_init_training_state"])
    assert {"num_training_steps", "optimizer"} <= set(parameters["create_scheduler"])
    assert {"resume_from_checkpoint", "model"} <= set(parameters["_load_from_checkpoint"])
    assert "checkpoint" in parameters["_load_optimizer_and_scheduler"]


def test_another_transformers_version_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "6.1.0")
    with pytest.raises(AdapterError, match=r"transformers 6\.1 is outside the versions bcp_transformers routes "
                                           r"the Trainer's checkpoints of \(5\.0 to before 6\.0\)"):
        bcp_transformers.install()


def test_a_moved_method_fails_naming_it_before_any_is_replaced(monkeypatch):
    monkeypatch.delattr(Trainer, "_save_rng_state")
    replaced = []
    with pytest.raises(MovedNameError, match=r"_save_rng_state is missing: .* transformers 5\.0 to before 6\.0"):
        transformers_patch.route(lambda original, through_bcp: replaced.append(original))
    assert replaced == []
