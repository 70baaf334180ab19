"""A resume through bcp gives Lightning's optimizer what Lightning's own checkpointing gives it
(``Optimizer.load_state_dict`` of the saved ``state_dict()``), entry for entry, for every
optimizer of ``torch.optim`` with each of its options, trained and saved before any step: under Lightning's single-device strategy
with ``BCPCheckpointIO`` and under bcp_lightning's DDP and FSDP2 strategies on 2 processes."""

from __future__ import annotations

import pytest

from lightning_launch import run
from optimizer_cases import NEVER_STEPPED, STEPS, failures, optimizer_cases


@pytest.mark.distributed
@pytest.mark.parametrize("strategy, world_size", [("single", 1), ("bcp_ddp", 2), ("bcp_fsdp2", 2)])
def test_a_resume_gives_what_load_state_dict_gives(tmp_path, strategy, world_size):
    """Trained, and saved before the first step (``Trainer.save_checkpoint`` as training starts)."""
    ids = [case.id for case in optimizer_cases()]
    cases = [{"case": "optimizer_semantics", "args": {"strategy": strategy, "dirpath": str(tmp_path / name),
                                                      "case_ids": case_ids, "steps": steps}}
             for name, case_ids, steps in [("trained", ids, STEPS), ("before", NEVER_STEPPED, 0)]]
    for found, found_before in run(world_size, cases, str(tmp_path / "launch")):
        assert not failures(found), failures(found)
        assert not failures(found_before), failures(found_before)
        assert sum(not diffs for diffs in found.values()) >= 35
        assert sum(not diffs for diffs in found_before.values()) >= 3
