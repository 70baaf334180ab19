"""Overlapped snapshots on real gloo ranks (``bcp.save(..., async_save=True, overlap=True)``): the
save returns before the parameters and optimizer state are copied, the next step's forward and
backward run meanwhile, and the snapshot is still the state at the call, bit for bit.

The copy is held back through its test seam (``snapshot_copy.BEFORE_COPY`` waits for a gate), so
the next step surely starts before it; a timer opens the gate shortly after the step's optimizer
is called, which must wait for it. A BatchNorm model's running statistics, which the forward pass
writes, are saved as they were at the call; a load and the next save wait for the copy; a copy
that fails fails the save on every rank and leaves the last checkpoint loadable; the memory tier
takes overlapped saves at every step."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from torch import nn

import bcp
from bcp.engine import snapshot_copy
from bcp.storage import LocalStorage
from models import assert_bitwise, build, full_state, rank, train

OPENS_AFTER_S = 0.3  # the gate opens this long after the optimizer is called (the failing case races it)


def _build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 7))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _forward_backward(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)  # every rank the same batch: the replicas stay equal
    x, y = torch.randn(8, 12, generator=g), torch.randn(8, 7, generator=g)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    _forward_backward(model, optimizer, step)
    optimizer.step()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model (buffers included) and of the optimizer, copied."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(optimizer.param_groups[0]["params"]):
        for key, value in optimizer.state.get(p, {}).items():
            out[f"optimizer/{i}/{key}"] = value.detach().clone()
    return out


def _loaded(target, step: int = 0) -> dict[str, torch.Tensor]:
    model, optimizer = _build(seed=99)
    _step(model, optimizer, step)  # other values everywhere, the optimizer's state made
    bcp.load(target, {"model": model, "optimizer": optimizer})
    return _state(model, optimizer)


class _HeldCopy:
    """The copy's seam: every overlapped copy waits for the gate, which :meth:`open_soon` opens."""

    def __init__(self, fail_on_rank: int | None = None) -> None:
        self.gate = threading.Event()
        self.fail_on_rank = fail_on_rank
        self.copies = 0  # copies that were overlapped (held here)

    def __enter__(self) -> "_HeldCopy":
        snapshot_copy.BEFORE_COPY = self._before_copy
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()
        snapshot_copy.BEFORE_COPY = None

    def _before_copy(self) -> None:
        self.copies += 1
        self.gate.wait()
        if rank() == self.fail_on_rank:
            raise OSError("a copy that fails")

    def open_soon(self) -> None:
        threading.Timer(OPENS_AFTER_S, self.gate.set).start()


def every_step_case(root: str) -> bool:
    """Steps 0-2, an overlapped save after each; the next step's forward and backward run while its
    copy is held back, then its optimizer steps (and waits). Each snapshot is the state at its call."""
    model, optimizer = _build(seed=0)
    expected, handles = [], []
    with _HeldCopy() as held:
        for step in range(3):
            _step(model, optimizer, step)
            expected.append(_state(model, optimizer))
            held.gate.clear()
            handles.append(bcp.save(os.path.join(root, f"step{step}"), {"model": model, "optimizer": optimizer},
                                    async_save=True, overlap=True, step=step))
            _forward_backward(model, optimizer, step + 1)  # writes BatchNorm's running statistics
            overlapped = not handles[-1].done()  # the copy is held: the save cannot have been written
            held.open_soon()
            optimizer.step()  # waits for the copy; without the wait it overwrites the parameters first
    assert held.copies == 3
    for handle in handles:
        handle.wait()
    for step, state in enumerate(expected):
        assert_bitwise(state, _loaded(os.path.join(root, f"step{step}")))
    return overlapped


def test_every_step_snapshot_is_the_state_at_the_call_while_the_next_step_runs(ranks, tmp_path):
    assert ranks(2).run(every_step_case, str(tmp_path)) == [True, True]


def sharded_case(root: str, kind: str) -> int:
    """A sharded model (DTensor parameters and optimizer state): the shards the optimizer steps are
    copied late, the snapshot is the state at the call."""
    model, optimizer = build(kind, seed=0)
    train(model, optimizer, range(0, 1))
    expected = full_state(model, optimizer)
    with _HeldCopy() as held:
        handle = bcp.save(root, {"model": model, "optimizer": optimizer}, async_save=True, overlap=True)
        held.open_soon()
        train(model, optimizer, range(1, 2))
        handle.wait()
    fresh, fresh_optimizer = build(kind, seed=5)
    train(fresh, fresh_optimizer, range(0, 1))
    bcp.load(root, {"model": fresh, "optimizer": fresh_optimizer})
    assert_bitwise(expected, full_state(fresh, fresh_optimizer))
    return held.copies


@pytest.mark.parametrize("kind", ["fsdp2", "tp"])
def test_sharded_parameters_are_copied_late_and_saved_as_at_the_call(ranks, tmp_path, kind):
    assert ranks(2).run(sharded_case, str(tmp_path), kind) == [1, 1]


def waits_case(root: str) -> int:
    """A load issued during the copy waits for it (the snapshot stays the state at the call); after
    ``wait_snapshot()`` parameters may be written outside the optimizer; the next save waits for
    the copy before it (and takes its optimizer hooks out)."""
    model, optimizer = _build(seed=1)
    _step(model, optimizer, 0)
    bcp.save(os.path.join(root, "older"), {"model": model, "optimizer": optimizer})
    _step(model, optimizer, 1)
    first = _state(model, optimizer)
    with _HeldCopy() as held:
        handle = bcp.save(os.path.join(root, "first"), {"model": model, "optimizer": optimizer}, async_save=True,
                          overlap=True)
        held.open_soon()
        bcp.load(os.path.join(root, "older"), {"model": model, "optimizer": optimizer})  # writes every tensor
        handle.wait()
        assert_bitwise(first, _loaded(os.path.join(root, "first")))

        held.gate.clear()
        handle = bcp.save(os.path.join(root, "second"), {"model": model, "optimizer": optimizer}, async_save=True,
                          overlap=True)
        held.open_soon()
        handle.wait_snapshot()
        second = _state(model, optimizer)
        with torch.no_grad():  # written outside the optimizer: after wait_snapshot()
            for p in model.parameters():
                p.mul_(2)
        handle.wait()
        assert_bitwise(second, _loaded(os.path.join(root, "second")))

        held.gate.clear()
        bcp.save(os.path.join(root, "third"), {"model": model, "optimizer": optimizer}, async_save=True, overlap=True)
        held.open_soon()
        handle = bcp.save(os.path.join(root, "fourth"), {"model": model, "optimizer": optimizer}, async_save=True,
                          overlap=True)  # waits for the third's copy
        hooks = len(optimizer._optimizer_step_pre_hooks)  # the third's taken out, the fourth's in
        handle.wait_snapshot()
    bcp.wait_pending_saves()
    return hooks + 10 * len(optimizer._optimizer_step_pre_hooks)


def test_load_next_save_and_wait_snapshot_wait_for_the_copy(ranks, tmp_path):
    assert ranks(2).run(waits_case, str(tmp_path)) == [1, 1]


def failed_copy_case(root: str) -> str:
    """Rank 1's copy fails: training goes on, every rank's handle raises, and the path still loads
    the checkpoint before."""
    model, optimizer = _build(seed=2)
    path = os.path.join(root, "ckpt")
    _step(model, optimizer, 0)
    good = _state(model, optimizer)
    bcp.save(path, {"model": model, "optimizer": optimizer})
    _step(model, optimizer, 1)
    with _HeldCopy(fail_on_rank=1) as held:
        handle = bcp.save(path, {"model": model, "optimizer": optimizer}, async_save=True, overlap=True)
        held.open_soon()
        _step(model, optimizer, 2)  # the step is not failed by the copy
        with pytest.raises(bcp.CheckpointError, match="a copy that fails") as failure:
            handle.wait()
    assert_bitwise(good, _loaded(path))
    return str(failure.value)


def test_a_failed_copy_fails_the_save_on_every_rank_not_the_step(ranks, tmp_path):
    for message in ranks(2).run(failed_copy_case, str(tmp_path)):
        assert "copying the parameters and optimizer state to host memory failed" in message


def tier_case(root: str) -> None:
    """Overlapped saves to the memory tier at every step; the tier loads the last one's snapshot."""
    model, optimizer = _build(seed=3)
    tier = bcp.MemoryTier(LocalStorage(os.path.join(root, "persistent")), local_dir=os.path.join(root, "tier"),
                          nodes=["a", "b"], persist_every=2)
    with _HeldCopy() as held:
        for step in range(3):
            _step(model, optimizer, step)
            expected = _state(model, optimizer)
            held.gate.clear()
            handle = bcp.save(tier, {"model": model, "optimizer": optimizer}, async_save=True, overlap=True, step=step)
            _forward_backward(model, optimizer, step + 1)
            held.open_soon()
            optimizer.step()
    handle.wait()
    assert_bitwise(expected, _loaded(tier))


def test_memory_tier_takes_overlapped_saves_at_every_step(ranks, tmp_path):
    ranks(2).run(tier_case, str(tmp_path))


def test_overlap_without_async_save_is_refused(tmp_path):
    model, optimizer = _build(seed=4)
    with pytest.raises(bcp.CheckpointError, match="pass async_save=True"):
        bcp.save(str(tmp_path), {"model": model, "optimizer": optimizer}, overlap=True)


def test_parameters_of_an_optimizer_outside_the_state_are_copied_at_the_call(tmp_path):
    """No hook can make an optimizer the save does not see wait: its parameters are copied at the
    call (the copy held back for ever does not hold this save back)."""
    model, optimizer = _build(seed=5)
    _step(model, optimizer, 0)
    expected = {name: value for name, value in _state(model, optimizer).items() if name.startswith("model/")}
    with _HeldCopy():
        handle = bcp.save(str(tmp_path), {"model": model}, async_save=True, overlap=True)
        _step(model, optimizer, 1)
        handle.wait()
    fresh, _ = _build(seed=99)
    bcp.load(str(tmp_path), {"model": fresh})
    assert_bitwise(expected, {f"model/{k}": v for k, v in fresh.state_dict().items()})
