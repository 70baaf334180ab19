"""A load that fails while its values go back to the live objects changes nothing either.

Saved param groups that do not fit the live ones (another number of groups, a group of other
parameters) are refused before any byte is placed, on every rank alike. A user's
``Stateful.load_state_dict`` that raises, after the model's bytes were placed and other objects
took their state, has every change taken back: the model (bytes placed by exchanging storages, and
a tensor in shared memory placed by copy), the optimizer's state and param groups, a scheduler, a
plain dict, a ``Stateful`` that took its state before, one whose ``state_dict()`` returns copies,
end bitwise as they were; so do a model given as a dict and an optimizer given as torch's FQN-keyed
state dict. On 2 ranks, a ``Stateful`` that raises on rank 1 only has rank 0, whose
apply succeeded, take its own back too.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import bcp
from optimizer_cases import differences


class Copying:
    """A ``Stateful`` whose ``state_dict()`` returns a copy of its tensor (loaded back by copying)."""

    def __init__(self, seed: int) -> None:
        self.weight = torch.full((4,), float(seed))

    def state_dict(self) -> dict[str, Any]:
        return {"weight": self.weight.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight.copy_(state["weight"])


class Counting:
    """A ``Stateful`` of the user's whose ``load_state_dict`` changes it, then raises where ``refuse``."""

    def __init__(self, count: int, refuse: bool = False) -> None:
        self.count, self.refuse = count, refuse

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]
        if self.refuse:
            raise ValueError("this count belongs to another run")


def _state(seed: int, groups: int = 1) -> dict[str, Any]:
    """Model, AdamW (trained ``seed`` steps, its parameters in ``groups`` groups), scheduler, a
    tensor in shared memory (placed by copy), a dict and three ``Stateful`` objects; the refusing
    one comes first, so that every other object has taken its state when it raises."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    params = list(model.parameters())
    split = [params[:2], params[2:]] if groups == 2 else [params]
    optimizer = torch.optim.AdamW([{"params": p, "lr": 1e-2 * (i + 1)} for i, p in enumerate(split)])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(seed):
        model(torch.randn(2, 8)).square().sum().backward()
        optimizer.step()
        scheduler.step()
    return {"refusing": Counting(seed), "model": model, "optimizer": optimizer, "scheduler": scheduler,
            "shared": torch.full((32,), float(seed)).share_memory_(), "progress": {"step": seed, "seen": [seed] * 3},
            "counter": Counting(seed), "copying": Copying(seed)}


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    model = state["model"]
    return copy.deepcopy({"model": model.state_dict(), "grads": [p.grad for p in model.parameters()],
                          "optimizer": state["optimizer"].state_dict(), "scheduler": state["scheduler"].state_dict(),
                          "shared": state["shared"], "progress": state["progress"], "counter": state["counter"].count,
                          "refusing": state["refusing"].count, "copying": state["copying"].weight})


def _failing_load(path: Path, state: dict[str, Any]) -> tuple[str, list[str]]:
    """The error of a load of ``path`` into ``state``, and what it changed."""
    before = _snapshot(state)
    with pytest.raises(bcp.CheckpointError) as raised:
        bcp.load(path, state)
    return str(raised.value), differences(before, _snapshot(state), "state")


def refused_groups(workdir: str, saved_groups: int, live_groups: int, subset: bool) -> tuple[str, list[str]]:
    """Saves with ``saved_groups`` param groups (``subset``: the optimizer steps the first layer
    only), loads into a state with ``live_groups``: the error and what changed."""
    path = Path(workdir) / f"groups-{saved_groups}-{live_groups}-{subset}"
    saved = _state(seed=3, groups=saved_groups)
    if subset:
        first = list(saved["model"][0].parameters())
        saved["optimizer"] = torch.optim.AdamW(first, lr=0.5)
        saved["optimizer"].step()  # state for the first layer's parameters only
        saved["scheduler"] = torch.optim.lr_scheduler.StepLR(saved["optimizer"], step_size=1)
    bcp.save(path, saved)
    return _failing_load(path, _state(seed=1, groups=live_groups))


@pytest.mark.parametrize("saved_groups, live_groups, subset, message", [
    (2, 1, False, "holds parameters that were saved in groups with different hyper-parameters"),
    (1, 1, True, r"parameter\(s\) \['2.weight', '2.bias'\] are in no saved param group"),
])
def test_param_groups_that_do_not_fit_are_refused_before_anything_changes(tmp_path, saved_groups, live_groups,
                                                                           subset, message):
    error, changed = refused_groups(str(tmp_path), saved_groups, live_groups, subset)
    assert not changed
    assert re.search(message, error), error
    assert str(tmp_path) in error and "optimizer/param_groups" in error


def raising_stateful(workdir: str, refusing_ranks: list[int]) -> tuple[str, list[str], bool]:
    """Saves every kind of state, then loads it where the object at ``refusing`` raises on
    ``refusing_ranks``: the error, what changed, and whether a load after it succeeds."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = Path(workdir) / "every-kind"
    bcp.save(path, _state(seed=3))
    state = _state(seed=1)
    state["refusing"].refuse = rank in refusing_ranks
    error, changed = _failing_load(path, state)
    state["refusing"].refuse = False
    bcp.load(path, state)  # the staging buffers and the objects serve the next load as before
    return error, changed, state["counter"].count == 3 and torch.equal(state["copying"].weight, torch.full((4,), 3.0))


def test_a_stateful_that_raises_has_every_change_taken_back(tmp_path):
    error, changed, loads_after = raising_stateful(str(tmp_path), [0])
    assert not changed
    assert "ValueError: this count belongs to another run" in error
    assert "'refusing'" in error and str(tmp_path) in error
    assert loads_after


def test_on_two_ranks_param_groups_that_do_not_fit_are_refused_on_both_unchanged(ranks, tmp_path):
    for error, changed in ranks(2).run(refused_groups, str(tmp_path), 2, 1, False):
        assert not changed and "different hyper-parameters" in error


def test_on_two_ranks_a_stateful_raising_on_one_has_both_take_their_changes_back(ranks, tmp_path):
    for rank, (error, changed, loads_after) in enumerate(ranks(2).run(raising_stateful, str(tmp_path), [1])):
        assert not changed, (rank, changed)
        assert "this count belongs to another run" in error
        assert loads_after


def test_an_fqn_keyed_optimizer_dict_and_a_dict_model_are_given_back_too(tmp_path):
    """The other objects an adapter takes: a model given as a dict of tensors and values, and an
    optimizer given as torch's FQN-keyed state dict (its per-parameter dicts refilled or emptied in
    place by the load)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def state(seed: int) -> dict[str, Any]:
        full = _state(seed)
        model, optimizer = full["model"], full["optimizer"]
        tensors = {**model.state_dict(), "note": f"run {seed}"}
        return {"refusing": full["refusing"], "model": tensors,
                "optimizer": get_optimizer_state_dict(model, optimizer)}

    saved = state(seed=3)
    for name in ("2.weight", "2.bias"):  # the load removes the live state of these, and clears it
        del saved["optimizer"]["state"][name]
    bcp.save(tmp_path, saved)
    live = state(seed=1)
    live["refusing"].refuse = True
    before = copy.deepcopy({"model": live["model"], "optimizer": live["optimizer"]})
    held = live["optimizer"]["state"]["2.weight"]  # a per-parameter dict the load empties
    with pytest.raises(bcp.CheckpointError, match="this count belongs to another run"):
        bcp.load(tmp_path, live)
    assert not differences(before, {"model": live["model"], "optimizer": live["optimizer"]}, "state")
    assert live["optimizer"]["state"]["2.weight"] is held


def test_a_place_that_fails_part_way_is_taken_back(tmp_path, monkeypatch):
    """Placing exchanged the model's storages, then the copy of the tensor in shared memory failed
    after its first byte landed. A mock, because host memory running out there cannot be produced
    safely for real: the copy raises MemoryError once it has written part of its target."""
    from bcp.engine.load_staging import Staging

    def failing_copy(self: Staging, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for live, staging in pairs:
            live.view(-1)[:1].copy_(staging.view(-1)[:1])
            raise MemoryError("no host memory left for the copy")

    bcp.save(tmp_path, _state(seed=3))
    state = _state(seed=1)
    before = _snapshot(state)
    monkeypatch.setattr(Staging, "_copy_into_live", failing_copy)
    with pytest.raises(Exception, match="no host memory left"):
        bcp.load(tmp_path, state)
    assert not differences(before, _snapshot(state), "state")
    monkeypatch.undo()
    bcp.load(tmp_path, state)
    assert torch.equal(state["shared"], torch.full((32,), 3.0))
