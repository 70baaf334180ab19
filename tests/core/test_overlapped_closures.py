"""An overlapped save (``async_save=True, overlap=True``) followed by ``optimizer.step(closure)``,
where the step runs the forward and backward itself (as Lightning's automatic optimization does):
a torch optimizer calls the closure while the copy is still held back and waits for the copy after
it, before the update; an optimizer from elsewhere, which may write parameters before it calls the
closure (a sharpness-aware one does), waits before its step. Either way each snapshot is the state at
the call, bit for bit. One process; the copy is held back through its seam
(``snapshot_copy.BEFORE_COPY``) until a gate opens."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import bcp
from bcp.engine import snapshot_copy
from models import assert_bitwise

GATE_TIMEOUT_S = 10.0  # only reached when the closure never runs while the copy is held


class MovesFirst(torch.optim.SGD):
    """A sharpness-aware-like optimizer: it moves the parameters, then calls the closure."""

    def step(self, closure=None):  # noqa: ANN001, ANN201
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                p.add_(0.5)
        loss = closure()
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                p.sub_(0.5)
        return super().step() or loss


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(optimizer.param_groups[0]["params"]):
        out.update({f"optimizer/{i}/{k}": v.clone() for k, v in optimizer.state.get(p, {}).items()})
    return out


def _closure(model: nn.Module, optimizer: torch.optim.Optimizer, events: list[str], then=None):  # noqa: ANN001, ANN202
    def closure() -> torch.Tensor:
        events.append("closure")
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(torch.ones(4, 6)), torch.zeros(4, 3))
        loss.backward()
        if then is not None:
            then()
        return loss
    return closure


@pytest.fixture
def gate(monkeypatch) -> tuple[threading.Event, list[str]]:
    """Each overlapped copy waits for the gate; the events in the order they happened."""
    opened, events = threading.Event(), []

    def before_copy() -> None:
        events.append("copy held")
        opened.wait(GATE_TIMEOUT_S)
        events.append("copy released" if opened.is_set() else "copy timed out")

    monkeypatch.setattr(snapshot_copy, "BEFORE_COPY", before_copy)
    return opened, events


def _loaded(path, make_optimizer) -> dict[str, torch.Tensor]:  # noqa: ANN001
    model = nn.Linear(6, 3)
    optimizer = make_optimizer(model.parameters())
    optimizer.step(_closure(model, optimizer, []))  # its state made, to load into
    bcp.load(path, {"model": model, "optimizer": optimizer})
    return _state(model, optimizer)


def _adamw(params) -> torch.optim.Optimizer:  # noqa: ANN001
    return torch.optim.AdamW(params, lr=0.1)


def _moves_first(params) -> torch.optim.Optimizer:  # noqa: ANN001
    return MovesFirst(params, lr=0.1, momentum=0.9)


def _stepped_then_saved(path, make_optimizer, events: list[str]):  # noqa: ANN001, ANN202
    """A model stepped once, its state then, and the overlapped save of it to ``path`` (copy held)."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    optimizer = make_optimizer(model.parameters())
    optimizer.step(_closure(model, optimizer, events))
    expected = _state(model, optimizer)
    handle = bcp.save(path, {"model": model, "optimizer": optimizer}, async_save=True, overlap=True)
    return model, optimizer, expected, handle


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_a_torch_optimizer_runs_the_closure_during_the_copy_and_updates_after_it(tmp_path, gate, how):
    opened, events = gate
    model, optimizer, expected, handle = _stepped_then_saved(tmp_path / "ckpt", _adamw, events)
    closure = _closure(model, optimizer, events, then=opened.set)  # the copy goes once the backward is done
    optimizer.step(closure=closure) if how == "keyword" else optimizer.step(closure)
    handle.wait()
    assert "copy timed out" not in events  # the closure ran while the copy was held
    assert_bitwise(expected, _loaded(tmp_path / "ckpt", _adamw))  # and the update waited for the copy


def test_an_optimizer_that_moves_parameters_before_its_closure_waits_before_its_step(tmp_path, gate):
    opened, events = gate
    model, optimizer, expected, handle = _stepped_then_saved(tmp_path / "ckpt", _moves_first, events)
    threading.Timer(0.3, opened.set).start()  # the step below waits for it, closure and all
    optimizer.step(_closure(model, optimizer, events))
    handle.wait()
    assert events[-3:] == ["copy held", "copy released", "closure"]
    assert_bitwise(expected, _loaded(tmp_path / "ckpt", _moves_first))
