"""``bcp_transformers.enable(trainer, async_save=True, overlap=True)`` with ``save_steps=1``: each
checkpoint's save returns before the weights and AdamW state are copied, the Trainer's optimizer
waits for the copy before it steps, and every ``checkpoint-<step>`` folder holds the state of its step
bit for bit although the next step ran while it was copied (the copy is held back on its thread,
``held_copies``, until the next update surely would have run). A real Trainer on one
CPU process."""

from __future__ import annotations

from typing import Any

import torch

from bcp.integration import open_checkpoint
from held_copies import hold_back_copies
from models import assert_bitwise
from trainer_helpers import fit

STEPS = 3


def as_stored(snapshot: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A ``trainer_helpers.snapshot``'s tensors under the names the checkpoint gives them."""
    out = {f"model/{name}": tensor for name, tensor in snapshot["model"].items()}
    for name, per_param in snapshot["optimizer"].items():
        out.update({f"optimizer/state/{name}/{key}": torch.as_tensor(value) for key, value in per_param.items()})
    return out


def test_every_step_overlapped_saves_hold_the_state_of_their_step(tmp_path, monkeypatch):
    held_back_copies = hold_back_copies(monkeypatch)
    run = fit(str(tmp_path), "bcp", None, {"save_steps": 1, "max_steps": STEPS},
              {"async_save": True, "overlap": True})
    assert sorted(run["at_save"]) == list(range(1, STEPS + 1))
    assert len(held_back_copies) == STEPS  # every save left the weights and AdamW state to its copy
    for step, snapshot in run["at_save"].items():
        expected = as_stored(snapshot)
        checkpoint = open_checkpoint(str(tmp_path / f"checkpoint-{step}"))
        assert_bitwise(expected, {name: checkpoint.read(name) for name in expected})
