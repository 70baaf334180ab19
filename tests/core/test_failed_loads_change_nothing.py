"""A load that fails changes nothing: for every optimizer of ``torch.optim`` with each of its
options (``optimizer_cases.py``), never stepped and trained, each way a load fails (a component name
the checkpoint lacks, a tensor of another shape, of another dtype, a flipped byte found by its
checksum, a missing data file) leaves the optimizer's ``state_dict()`` (deep, every tensor byte)
and the model (parameters, buffers, gradients) exactly as they were. A load with ``strict=False``
from a checkpoint without the optimizer loads the model and leaves the optimizer as it was. The
same failures leave a scheduler, a plain dict, a ``Stateful`` object and a per-rank value as they were.

Guards a past defect: the optimizer's state was created (by a step at a zero learning rate) while
the load planned, before the names were matched, and a load that then failed left a never-stepped
AdamW holding zero moments at ``step=1``, one bias correction away from a fresh start."""

from __future__ import annotations

import contextlib
import copy
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import bcp
from models import read_manifest, world
from optimizer_cases import STEPS, build, differences, optimizer_cases, torch_runs, train

FAILURES = ["name", "shape", "dtype", "flipped-byte", "missing-file"]
EXTRA = torch.arange(6.0)  # a plain tensor saved beside model and optimizer


def live_state(model: nn.Module) -> dict[str, Any]:
    """A deep copy of what a load must not change in the model: its state dict and gradients."""
    return copy.deepcopy({"state": model.state_dict(), "grads": {n: p.grad for n, p in model.named_parameters()}})


def failing_loads(layout: str, workdir: str, case_ids: list[str] | None = None) -> dict[str, list[str]]:
    """For every case torch runs in ``layout`` (of ``case_ids``), never stepped and trained, and
    every failure: what the failing load changed in the optimizer's state dict and the model
    (``raised nothing`` where it did not fail). A ``not-saved`` entry per case: what a
    ``strict=False`` load from a checkpoint without the optimizer changed in the optimizer."""
    found: dict[str, list[str]] = {}
    for number, case in enumerate(optimizer_cases()):
        if (case_ids is not None and case.id not in case_ids) or torch_runs(case, layout) is not None:
            continue
        saved_model, saved_optimizer = build(case, layout, seed=1)  # another run: a load would change both
        train(saved_model, saved_optimizer, range(STEPS))
        path = Path(workdir) / str(number)
        bcp.save(path, {"model": saved_model, "optimizer": saved_optimizer, "extra": EXTRA})
        model_only = Path(workdir) / f"{number}-model-only"
        bcp.save(model_only, {"model": saved_model})
        for steps in (0, STEPS):
            model, optimizer = build(case, layout, seed=2)
            train(model, optimizer, range(steps))
            for failure in FAILURES:
                found[f"{case.id}/{steps}/{failure}"] = _changed_by_failing_load(path, failure, model, optimizer)
            before = copy.deepcopy(optimizer.state_dict())
            bcp.load(model_only, {"model": model, "optimizer": optimizer}, strict=False)
            found[f"{case.id}/{steps}/not-saved"] = differences(before, optimizer.state_dict())
    return found


def _changed_by_failing_load(path: Path, failure: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    state = {"model": model, "optimizer": optimizer, "extra": torch.zeros_like(EXTRA)}
    if failure == "name":
        state["optimiser"] = state.pop("optimizer")
    elif failure == "shape":
        state["extra"] = torch.zeros(len(EXTRA) + 1)
    elif failure == "dtype":
        state["extra"] = torch.zeros_like(EXTRA, dtype=torch.float64)
    before_optimizer, before_model = copy.deepcopy(optimizer.state_dict()), live_state(model)
    with _damaged(path, failure):
        try:
            bcp.load(path, state)
        except bcp.CheckpointError:
            pass
        else:
            return ["raised nothing"]
    return [*differences(before_optimizer, optimizer.state_dict(), "optimizer"),
            *differences(before_model, live_state(model), "model")]


@contextlib.contextmanager
def _damaged(path: Path, failure: str) -> Iterator[None]:
    """The checkpoint at ``path`` with a flipped byte or without a data file while the block runs
    (rank 0 damages and repairs it, every rank waits)."""
    if failure not in ("flipped-byte", "missing-file"):
        yield
        return
    manifest = read_manifest(path)
    stored = manifest.tensors["extra"].shards[0].bytes  # "extra" is read by every load
    victim = path / f"gen-{manifest.generation:08d}" / manifest.files[stored.file]
    original = victim.read_bytes() if _rank() == 0 else b""
    if _rank() == 0 and failure == "missing-file":
        victim.unlink()
    elif _rank() == 0:
        raw = bytearray(original)
        raw[stored.offset + 1] ^= 0x10
        victim.write_bytes(bytes(raw))
    _barrier()
    try:
        yield
    finally:
        _barrier()
        if _rank() == 0:
            victim.write_bytes(original)
        _barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if world() > 1:
        dist.barrier()


def _changes(found: dict[str, list[str]]) -> dict[str, list[str]]:
    return {key: diffs for key, diffs in found.items() if diffs}


def test_every_failing_load_leaves_every_optimizer_and_its_model_as_they_were(tmp_path):
    found = failing_loads("plain", str(tmp_path))
    assert not _changes(found), _changes(found)
    cases = {key.split("/")[0] for key in found}
    assert len(cases) >= 50 and {"AdamW", "LBFGS", "SparseAdam", "Adafactor"} <= cases
    assert len(found) == len(cases) * 2 * (len(FAILURES) + 1)


def test_the_same_on_two_ranks_under_ddp(ranks, tmp_path):
    for rank_found in ranks(2).run(failing_loads, "ddp", str(tmp_path)):
        assert not _changes(rank_found), _changes(rank_found)
        assert len({key.split("/")[0] for key in rank_found}) >= 40


def test_a_never_stepped_adamw_keeps_no_state_after_a_typo(tmp_path):
    """The defect as a user met it: after the failed load the next step is the first."""
    model, optimizer = build(next(c for c in optimizer_cases() if c.id == "AdamW"), "plain", seed=1)
    train(model, optimizer, range(2))
    bcp.save(tmp_path, {"model": model, "optimizer": optimizer})
    fresh, fresh_optimizer = build(next(c for c in optimizer_cases() if c.id == "AdamW"), "plain", seed=2)
    with pytest.raises(bcp.MismatchError, match="optimiser"):
        bcp.load(tmp_path, {"model": fresh, "optimiser": fresh_optimizer})
    assert fresh_optimizer.state_dict()["state"] == {}


class Counter:
    """A ``Stateful`` object of the user's."""

    def __init__(self, count: int) -> None:
        self.count = count

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


def _every_kind(seed: int) -> dict[str, Any]:
    """A model, its AdamW, a scheduler, a plain dict, a Stateful object and a per-rank value."""
    model, optimizer = build(next(c for c in optimizer_cases() if c.id == "AdamW"), "plain", seed=seed)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train(model, optimizer, range(seed))
    for _ in range(seed):
        scheduler.step()
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "extra": torch.full((6,), float(seed)),
            "progress": {"step": seed, "history": [seed] * 3}, "counter": Counter(seed), "seed": seed}


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy({"model": live_state(state["model"]), "optimizer": state["optimizer"].state_dict(),
                          "scheduler": state["scheduler"].state_dict(), "extra": state["extra"],
                          "progress": state["progress"], "counter": state["counter"].count, "seed": state["seed"]})


@pytest.mark.parametrize("failure", FAILURES)
def test_schedulers_dicts_statefuls_and_per_rank_values_stay_as_they_were(tmp_path, failure):
    bcp.save(tmp_path, {**_every_kind(seed=3), "extra": EXTRA})
    state = _every_kind(seed=1)
    if failure == "name":
        state["optimiser"] = state.pop("optimizer")
    elif failure in ("shape", "dtype"):
        state["extra"] = torch.zeros(7) if failure == "shape" else torch.zeros(6, dtype=torch.float64)
    live = {**state, "optimizer": state.get("optimizer", state.get("optimiser"))}
    before = _snapshot(live)
    with _damaged(tmp_path, failure), pytest.raises(bcp.CheckpointError):
        bcp.load(tmp_path, state)
    assert not differences(before, _snapshot(live))
    assert state["scheduler"].optimizer is live["optimizer"]
