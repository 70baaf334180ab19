"""The switch (environment variable, ``enable``, the subclass) and every error a user can meet, in
one process with real Accelerators."""

from __future__ import annotations

import os

import pytest
import torch
from accelerate.utils import DistributedType, ProjectConfiguration
from torch import nn

import bcp
import bcp_accelerate
from accelerate_helpers import session
from bcp_accelerate.engine import check_supported

VARIABLE = bcp_accelerate.ENGINE_VARIABLE


@pytest.mark.parametrize("value,engine", [(None, None), ("", None), (" BCP ", "bcp"), ("accelerate", "accelerate")])
def test_engine_variable(monkeypatch, value, engine):
    if value is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, value)
    assert bcp_accelerate.requested_engine() == engine


def test_misspelled_engine_fails_the_save_before_writing(tmp_path):
    with session("bpc") as accelerator:
        with pytest.raises(bcp.CheckpointError) as failure:
            accelerator.save_state(str(tmp_path / "ckpt"))
    assert str(failure.value) == (f"{VARIABLE}='bpc' names no checkpoint engine: use one of bcp, accelerate, "
                                  "or leave it unset")
    assert not (tmp_path / "ckpt").exists()


def test_switch_precedence():
    with session() as accelerator:
        assert not bcp_accelerate.uses_bcp(accelerator)
        assert bcp_accelerate.enable(accelerator) is accelerator and bcp_accelerate.uses_bcp(accelerator)
        assert bcp_accelerate.uses_bcp(bcp_accelerate.Accelerator(cpu=True))
        os.environ[VARIABLE] = "accelerate"  # restored by the session
        assert not bcp_accelerate.uses_bcp(accelerator)
    with session("bcp") as accelerator:
        assert bcp_accelerate.uses_bcp(accelerator)
    with pytest.raises(TypeError, match="enable\\(\\) takes an accelerate.Accelerator, got Linear"):
        bcp_accelerate.enable(nn.Linear(1, 1))


@pytest.mark.parametrize("kind,name", [(DistributedType.DEEPSPEED, "DeepSpeed"),
                                       (DistributedType.MEGATRON_LM, "Megatron-LM"), (DistributedType.XLA, "XLA")])
def test_engines_with_their_own_state_are_refused(kind, name):
    with pytest.raises(bcp.AdapterError) as failure:
        check_supported(kind)
    assert str(failure.value) == (f"the bcp checkpoint engine does not handle {name} models through accelerate; "
                                  f"unset {VARIABLE} (or do not enable bcp) to use accelerate's own engine")


@pytest.mark.parametrize("kind", [DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU,
                                  DistributedType.FSDP])
def test_torch_native_engines_are_supported(kind):
    check_supported(kind)


def test_optimizer_over_a_parameter_of_no_model(tmp_path):
    with session("bcp") as accelerator:
        model, temperature = nn.Linear(3, 2), nn.Parameter(torch.ones(4))
        accelerator.prepare(model, torch.optim.SGD([*model.parameters(), temperature], lr=0.1))
        with pytest.raises(bcp.AdapterError) as failure:
            accelerator.save_state(str(tmp_path / "ckpt"))
    assert str(failure.value) == (
        "optimizer 0 updates a parameter of shape (4,) that is in none of the prepared models; bcp names optimizer "
        "state by parameter name, so pass the module that owns it through accelerator.prepare() too")


def test_folder_errors(tmp_path):
    with session("bcp") as accelerator:
        accelerator.prepare(nn.Linear(3, 2))
        with pytest.raises(ValueError, match="save_state\\(\\) needs an output_dir when automatic checkpoint "
                                             "naming is disabled"):
            accelerator.save_state()
        with pytest.raises(ValueError, match="load_state\\(\\) needs an input_dir when automatic checkpoint "
                                             "naming is disabled"):
            accelerator.load_state()
        with pytest.raises(ValueError, match="load_state\\(\\): no such checkpoint folder .*missing"):
            accelerator.load_state(str(tmp_path / "missing"))
        (tmp_path / "empty").mkdir()
        with pytest.raises(bcp.CheckpointNotCommittedError, match="cannot load: the folder holds no complete "
                                                                  "checkpoint: a save into it was interrupted"):
            accelerator.load_state(str(tmp_path / "empty"))


def test_automatic_naming_errors(tmp_path):
    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    with session("bcp", project_config=project) as accelerator:
        accelerator.prepare(nn.Linear(3, 2))
        with pytest.raises(bcp.CheckpointNotCommittedError, match="no checkpoint to resume from under .*checkpoints: "
                                                                  "no checkpoint_<n> folder"):
            accelerator.load_state()
        accelerator.save_state()
        accelerator.project_configuration.iteration = 0
        with pytest.raises(ValueError, match="checkpoint_0 already holds a checkpoint; set "
                                             "accelerator.project_configuration.iteration"):
            accelerator.save_state()


def test_load_options(tmp_path):
    path = str(tmp_path / "ckpt")
    with session("bcp") as accelerator:
        torch.manual_seed(0)
        saved = accelerator.prepare(nn.Sequential(nn.Linear(3, 2)))
        accelerator.save_state(path)
    with session("bcp") as accelerator:
        model = accelerator.prepare(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)))
        with pytest.raises(TypeError, match="load_state\\(\\) through bcp takes no assign, device \\(its model "
                                            "options are strict, map_location, generation\\)"):
            accelerator.load_state(path, device="cpu", assign=True)
        with pytest.raises(bcp.MismatchError, match="strict load: missing from the checkpoint: model/1.bias, "
                                                    "model/1.weight"):
            accelerator.load_state(path)
        accelerator.load_state(path, strict=False, map_location="cpu")
        assert torch.equal(model[0].weight, saved[0].weight)


def test_a_bcp_checkpoint_not_saved_by_accelerate(tmp_path):
    path = str(tmp_path / "plain")
    with session("bcp") as accelerator:
        model = accelerator.prepare(nn.Linear(3, 2))
        bcp.save(path, {"model": model})
        with pytest.raises(bcp.MismatchError) as failure:
            accelerator.load_state(path)
    assert str(failure.value) == ("this bcp checkpoint has no 'accelerate' record: it was not written by "
                                  f"Accelerator.save_state; load it with bcp.load (checkpoint {path!r})")
