"""A load restores the optimizer as ``torch.optim.Optimizer.load_state_dict`` does: state the
checkpoint does not hold is removed (not reported missing), hyper-parameters are the saved ones;
``strict`` still refuses a parameter whose state is saved only in part."""

from __future__ import annotations

import pytest
import torch

import bcp
from models import assert_bitwise, build, full_state, train


def _fresh_step(kind: str, step: int) -> dict[str, torch.Tensor]:
    model, optimizer = build(kind, seed=1)
    train(model, optimizer, range(step, step + 1))
    return full_state(model, optimizer)


def test_a_checkpoint_saved_before_any_step_empties_the_optimizer(tmp_path):
    """The defect: the load reported the state created since (exp_avg, exp_avg_sq, step of every
    parameter) as missing from the checkpoint."""
    path = str(tmp_path / "ckpt")
    model, optimizer = build("plain", seed=1)
    bcp.save(path, {"model": model, "optimizer": optimizer})
    train(model, optimizer, range(3))
    optimizer.param_groups[0]["lr"] = 0.5
    result = bcp.load(path, {"model": model, "optimizer": optimizer})
    assert not any(optimizer.state.values()) and result.missing == []
    assert optimizer.param_groups[0]["lr"] == 1e-2
    train(model, optimizer, range(5, 6))
    assert_bitwise(_fresh_step("plain", 5), full_state(model, optimizer))


def save_before_any_step(path: str) -> None:
    model, optimizer = build("fsdp2", seed=1)
    bcp.save(path, {"model": model, "optimizer": optimizer})


def test_the_same_across_a_layout_change(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_before_any_step, path)
    model, optimizer = build("plain", seed=7)
    train(model, optimizer, range(2))
    bcp.load(path, {"model": model, "optimizer": optimizer})
    assert not any(optimizer.state.values())
    train(model, optimizer, range(5, 6))
    assert_bitwise(_fresh_step("plain", 5), full_state(model, optimizer))


def test_parameters_without_saved_state_lose_theirs_the_others_load(tmp_path):
    """A rollback to a checkpoint taken while part of the model was frozen."""
    path = str(tmp_path / "ckpt")
    model, optimizer = build("plain", seed=1)
    model.fc2.requires_grad_(False)
    train(model, optimizer, range(2))
    saved = {k: v.clone() for k, v in optimizer.state[model.fc1.weight].items()}
    bcp.save(path, {"model": model, "optimizer": optimizer})
    model.fc2.requires_grad_(True)
    train(model, optimizer, range(2, 4))
    bcp.load(path, {"model": model, "optimizer": optimizer})
    assert model.fc2.weight not in optimizer.state and model.fc2.bias not in optimizer.state
    assert all(torch.equal(saved[k], optimizer.state[model.fc1.weight][k]) for k in saved)


def test_strict_refuses_a_parameter_whose_state_is_saved_in_part(tmp_path):
    path = str(tmp_path / "ckpt")
    model, optimizer = build("plain", seed=1)
    train(model, optimizer, range(1))
    bcp.save(path, {"model": model, "optimizer": optimizer})
    bcp.remove_entries(path, ["optimizer/state/fc1.weight/exp_avg_sq"])
    with pytest.raises(bcp.MismatchError, match="optimizer/state/fc1.weight/exp_avg_sq"):
        bcp.load(path, {"model": model, "optimizer": optimizer})
    result = bcp.load(path, {"model": model, "optimizer": optimizer}, strict=False)
    assert result.missing == ["optimizer/state/fc1.weight/exp_avg_sq"]
