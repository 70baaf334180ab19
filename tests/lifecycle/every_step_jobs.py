"""A rank of ``examples/every_step_torchrun.py`` in the fresh-process tier (``zygote.py``): the
example's FSDP2 MLP with AdamW and its training step, 2 ranks posing as 2 nodes, an asynchronous,
overlapped memory-tier save after every step (each rank's files copied to the peer node over bcp's
gloo groups), the last one left pending; the script then ends the way users' scripts do."""

from __future__ import annotations

import os
import sys

import bcp
from lifecycle_jobs import _join, _leave

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
import every_step_torchrun  # noqa: E402

STEPS = 4


def tier_every_step_then_leave(tier_dir: str, hidden: int, how: str, destroy: bool) -> None:
    _join()
    model, optimizer = every_step_torchrun.build(hidden)
    tier = bcp.MemoryTier(None, local_dir=tier_dir, nodes=["a", "b"])
    state = {"model": model, "optimizer": optimizer, "extra_state": {"step": 0}}
    for step in range(1, STEPS + 1):
        every_step_torchrun.train_step(model, optimizer, step)
        state["extra_state"]["step"] = step
        bcp.save(tier, state, async_save=True, overlap=True)
    _leave(how, destroy)
