"""memory:// checkpoints: one process's fast snapshots, refused where several ranks would need to share them."""

from __future__ import annotations

import bcp
import torch
from models import assert_bitwise, build, full_state, train


def save_to_memory() -> str:
    try:
        bcp.save("memory://several/run", {"model": {"w": torch.ones(2)}})
    except (bcp.CheckpointError, ValueError) as exc:
        return str(exc)
    return "saved"


def test_memory_storage_refuses_a_save_on_several_ranks(ranks):
    for message in ranks(2).run(save_to_memory):
        assert "memory://several/run" in message and "process-local" in message


def test_a_memory_url_holds_a_checkpoint_for_the_rest_of_the_process():
    model, optimizer = build("plain", seed=1)
    train(model, optimizer, range(2))
    bcp.save("memory://snapshots/run", {"model": model, "optimizer": optimizer})
    fresh, fresh_optimizer = build("plain", seed=2)
    bcp.load("memory://snapshots/run", {"model": fresh, "optimizer": fresh_optimizer})
    assert_bitwise(full_state(model, optimizer), full_state(fresh, fresh_optimizer))
