"""``Accelerator.load_state`` through bcp gives each optimizer what accelerate's own engine gives
(``Optimizer.load_state_dict`` of the saved ``state_dict()``), entry for entry, for every optimizer
of ``torch.optim`` with each of its options, trained and saved before any step: on one process,
under DDP and under accelerate's FSDP2 on 2 processes. Accelerate's own ``test_state_checkpointing.py`` compares the same way
(``optimizer.state_dict() ==``): the difference it found was empty per-parameter entries bcp left
where torch leaves none."""

from __future__ import annotations

import pytest
from accelerate_helpers import session

from optimizer_cases import (
    NEVER_STEPPED,
    STEPS,
    OptimizerCase,
    differences,
    failures,
    loaded_by_torch,
    model_for,
    optimizer_cases,
    refusal,
    saved_state,
    train,
)


def _prepared(accelerator, case: OptimizerCase, seed: int):
    import torch

    torch.manual_seed(seed)
    model = model_for(case)
    return accelerator.prepare(model, case.make(model.parameters()))


def _torch_refuses(case: OptimizerCase, fsdp2: bool) -> str | None:
    """torch's error where it cannot train ``case`` under accelerate here, or take its ``state_dict()``:
    Adagrad and L-BFGS key state by the parameters they were built with, which accelerate's FSDP2
    preparation replaces, so accelerate's own engine fails on them as well."""
    with session(fsdp2=fsdp2) as accelerator:
        model, optimizer = _prepared(accelerator, case, seed=0)
        return refusal(lambda: (train(model, optimizer, range(1)), optimizer.state_dict()))


def compare_through_accelerate(fsdp2: bool, workdir: str, steps: int = STEPS,
                               case_ids: list[str] | None = None) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for number, case in enumerate(optimizer_cases()):
        if case_ids is not None and case.id not in case_ids:
            continue
        path = f"{workdir}/{number}"
        refused = _torch_refuses(case, fsdp2)
        if refused is not None:
            found[case.id] = [f"skipped: {refused}"]
            continue
        with session("bcp", fsdp2=fsdp2) as accelerator:
            model, optimizer = _prepared(accelerator, case, seed=1)
            train(model, optimizer, range(steps))
            accelerator.save_state(path)
            torch_saved = saved_state(optimizer.optimizer)
        with session("bcp", fsdp2=fsdp2) as accelerator:
            model, optimizer = _prepared(accelerator, case, seed=2)
            accelerator.load_state(path)
            expected = loaded_by_torch(case, model, torch_saved).state_dict()
            found[case.id] = differences(expected, optimizer.state_dict())
    return found


def test_load_state_gives_what_accelerates_engine_gives(ranks, tmp_path):
    found = ranks(1).run(compare_through_accelerate, False, str(tmp_path / "trained"))[0]
    found_before = ranks(1).run(compare_through_accelerate, False, str(tmp_path / "before"), 0, NEVER_STEPPED)[0]
    for one in (found, found_before):
        assert not failures(one), failures(one)
    assert sum(not diffs for diffs in found.values()) >= 50 and all(not diffs for diffs in found_before.values())


@pytest.mark.parametrize("fsdp2", [False, True], ids=["ddp", "fsdp2"])
def test_the_same_on_two_processes(ranks, tmp_path, fsdp2):
    found = ranks(2).run(compare_through_accelerate, fsdp2, str(tmp_path / "trained"))
    found_before = ranks(2).run(compare_through_accelerate, fsdp2, str(tmp_path / "before"), 0, NEVER_STEPPED)
    for rank_found in [*found, *found_before]:
        assert not failures(rank_found), failures(rank_found)
    assert sum(not diffs for diffs in found[0].values()) >= 35
    assert sum(not diffs for diffs in found_before[0].values()) >= 3
