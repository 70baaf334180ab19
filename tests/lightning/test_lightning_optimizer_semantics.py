"""A resume through bcp gives Lightning's optimizer what Lightning's own checkpointing gives it
(``Optimizer.load_state_dict`` of the saved ``state_dict()``), entry for entry, for every
optimizer of ``torch.optim`` with each of its options: under Lightning's single-device strategy
with ``BCPCheckpointIO`` and under bcp_lightning's DDP and FSDP2 strategies on 2 processes."""

from __future__ import annotations

import pytest

from lightning_launch import run
from optimizer_cases import failures, optimizer_cases


@pytest.mark.distributed
@pytest.mark.parametrize("strategy, world_size", [("single", 1), ("bcp_ddp", 2), ("bcp_fsdp2", 2)])
def test_a_resume_gives_what_load_state_dict_gives(tmp_path, strategy, world_size):
    ids = [case.id for case in optimizer_cases()]
    case = {"case": "optimizer_semantics", "args": {"strategy": strategy, "dirpath": str(tmp_path), "case_ids": ids}}
    for found, in run(world_size, [case], str(tmp_path / "launch")):
        assert not failures(found), failures(found)
        assert sum(not diffs for diffs in found.values()) >= 35
