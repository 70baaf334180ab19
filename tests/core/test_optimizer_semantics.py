"""After ``bcp.load`` an optimizer's ``state_dict()`` equals what ``Optimizer.load_state_dict``
gives from torch's own checkpoint of it, entry for entry (keys, types, ``None`` values, empty
per-parameter entries, every tensor byte, the param groups), for every optimizer of
``torch.optim`` with each of its options, on a plain model, under DDP and under FSDP2."""

from __future__ import annotations

import copy

import pytest
import torch

import bcp
from optimizer_cases import (
    NEVER_STEPPED,
    STEPS,
    OptimizerCase,
    build,
    compare_cases,
    differences,
    failures,
    loaded_by_torch,
    optimizer_cases,
    optimizer_classes,
    saved_state,
    train,
)


def _save(case: OptimizerCase, model, optimizer, path: str) -> None:
    bcp.save(path, {"model": model, "optimizer": optimizer})


def _load(case: OptimizerCase, model, optimizer, path: str) -> None:
    bcp.load(path, {"model": model, "optimizer": optimizer})


def compare_in(layout: str, workdir: str, steps: int = STEPS, case_ids: list[str] | None = None) -> dict[str, list[str]]:
    return compare_cases(layout, _load, _save, workdir, steps, case_ids)


def test_the_cases_are_every_optimizer_of_torch_optim_with_its_options():
    names = optimizer_classes()
    assert {"Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "LBFGS", "SparseAdam", "ASGD", "Rprop"} <= set(names)
    ids = {case.id for case in optimizer_cases()}
    assert {"Adam-amsgrad=True", "SGD-momentum=0.9", "RMSprop-centered=True", "Adam-foreach=True",
            "Adam-capturable=True", "Adam-fused=True"} <= ids
    assert all(any(case.name == name for case in optimizer_cases()) for name in names)


@pytest.mark.parametrize("steps", [STEPS, 0], ids=["trained", "saved-before-any-step"])
def test_bcp_load_gives_what_load_state_dict_gives(tmp_path, steps):
    found = compare_in("plain", str(tmp_path), steps)
    assert not failures(found), failures(found)
    ran = [case for case, diffs in found.items() if not diffs]
    assert len(ran) >= 50 and "LBFGS" in ran and "SparseAdam" in ran


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_the_same_on_two_ranks(ranks, tmp_path, layout):
    found = ranks(2).run(compare_in, layout, str(tmp_path / "trained"))
    found_before = ranks(2).run(compare_in, layout, str(tmp_path / "before"), 0, NEVER_STEPPED)
    for rank_found in [*found, *found_before]:
        assert not failures(rank_found), failures(rank_found)
    assert sum(not diffs for diffs in found[0].values()) >= 40
    assert sum(not diffs for diffs in found_before[0].values()) >= 4


def test_empty_entries_and_none_values_come_back(tmp_path):
    """torch keeps a per-parameter entry with no key (code that looks a parameter up in the
    state's defaultdict makes one) and a ``None`` value (SGD's momentum buffer as torch saved it
    before 2.0); bcp used to drop the first and refuse the second."""
    for case in [OptimizerCase("SGD"), OptimizerCase("SGD", {"momentum": 0.9}), OptimizerCase("Adam")]:
        model, optimizer = build(case, "plain", seed=1)
        train(model, optimizer, range(STEPS))
        saved = optimizer.state_dict()
        saved["state"][0] = {"momentum_buffer": None} if case.name == "SGD" else saved["state"][0]
        saved["state"][1] = {}
        optimizer.load_state_dict(saved)
        path = str(tmp_path / case.id)
        bcp.save(path, {"model": model, "optimizer": optimizer})
        torch_saved = saved_state(optimizer)
        fresh, by_bcp = build(case, "plain", seed=2)
        train(fresh, by_bcp, range(5))  # live state to be replaced, not merged into
        bcp.load(path, {"model": fresh, "optimizer": by_bcp})
        expected = loaded_by_torch(case, fresh, torch_saved).state_dict()
        assert 1 in expected["state"] and expected["state"][1] == {}
        assert differences(expected, by_bcp.state_dict()) == [], case.id


def test_hyper_parameters_are_the_saved_ones_and_no_others(tmp_path):
    model, optimizer = build(OptimizerCase("Adam"), "plain", seed=1)
    optimizer.param_groups[0]["lr"] = 0.25
    bcp.save(str(tmp_path), {"model": model, "optimizer": optimizer})
    fresh, live = build(OptimizerCase("Adam"), "plain", seed=2)
    live.param_groups[0]["added_by_a_scheduler"] = 1.0
    bcp.load(str(tmp_path), {"model": fresh, "optimizer": live})
    expected = copy.deepcopy(optimizer.state_dict()["param_groups"])
    assert differences(expected, live.state_dict()["param_groups"]) == []
    assert torch.equal(next(fresh.parameters()), next(model.parameters()))
