"""``bcp_accelerate.enable(accelerator, memory_tier=tier, async_save=True, overlap=True)`` with
``save_state()`` after every step: each save returns before the parameters and AdamW state are
copied, the prepared optimizer waits for the copy before it steps, and each generation holds the
state of its step bit for bit although the next step ran while it was copied (the copy is held back
on its thread, ``held_copies``, until the next update surely would have run).
A real accelerator on one CPU process; the tier persists every save, where each generation is read
back once the next step is done."""

from __future__ import annotations

import torch

import bcp
import bcp_accelerate
from accelerate_helpers import build, session, train
from bcp.integration import open_checkpoint
from held_copies import hold_back_copies
from models import assert_bitwise, model_state

STEPS = 4


def saved_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The live model and AdamW tensors under the names the checkpoint gives them, cloned."""
    out = {name: value.clone() for name, value in model_state(model).items()}
    names = {id(p): name for name, p in model.named_parameters()}
    for p, per_param in optimizer.state.items():
        out.update({f"optimizer/state/{names[id(p)]}/{key}": value.clone() for key, value in per_param.items()})
    return out


def stored(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    checkpoint = open_checkpoint(path)
    return {name: checkpoint.read(name) for name in names}


def test_every_step_overlapped_saves_hold_the_state_of_their_step(tmp_path, monkeypatch):
    held_back_copies = hold_back_copies(monkeypatch)
    persistent = str(tmp_path / "persistent")
    tier = bcp.MemoryTier(persistent, local_dir=tmp_path / "shm", persist_every=1, replicas=0)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with session() as accelerator:
        bcp_accelerate.enable(accelerator, memory_tier=tier, async_save=True, overlap=True)
        model, optimizer, scheduler = build(accelerator, seed=1)
        for step in range(1, STEPS + 1):
            train(accelerator, model, optimizer, scheduler, range(step - 1, step))  # ran while the copy was held
            if step > 1:
                bcp.wait_pending_saves()  # the previous step's save committed, and persisted
                assert_bitwise(expected[step - 1], stored(persistent, list(expected[step - 1])))
            expected[step] = saved_state(model, optimizer)
            accelerator.save_state()
        accelerator.load_state()  # waits for the last save first
        assert_bitwise(expected[STEPS], saved_state(model, optimizer))
    assert len(held_back_copies) == STEPS  # every save left the parameters and AdamW state to its copy
