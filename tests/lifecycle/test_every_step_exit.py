"""Every rank of an every-step memory-tier job (``examples/every_step_torchrun.py``'s loop: FSDP2,
AdamW, an asynchronous, overlapped save to the tier after each step, replicated to the peer node, the
last one left pending) exits as its script says: code 0 after a return or ``sys.exit(0)``, 1 after
an error, with or without ``destroy_process_group()``; never a signal (a gloo group or thread left
to the interpreter's teardown aborts a process with "terminate called without an active
exception"). Fresh processes (``zygote.py``); the state (hidden 2048, as the example's benchmark
runs it: 51 MiB of model and AdamW state) makes each rank's file take two chunks of the tier's
transfers to its peer."""

from __future__ import annotations

import pytest

import bcp
from zygote import Zygote

HIDDEN = 2048


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


@pytest.mark.parametrize("how, destroy, code", [("return", True, 0), ("exit", False, 0), ("raise", True, 1)])
def test_every_rank_of_an_every_step_tier_job_exits_as_its_script_says(zygote, tmp_path, how, destroy, code):
    result = zygote.run("every_step_jobs:tier_every_step_then_leave", 2, str(tmp_path / "tier"), HIDDEN, how, destroy)
    got = [(rank.code, rank.signal) for rank in result.ranks]
    assert not result.timed_out and got == [(code, None), (code, None)], result.describe()
    state = {"extra_state": {"step": 0}}
    bcp.load(bcp.MemoryTier(None, local_dir=tmp_path / "tier", nodes=["a"]), state)
    assert state["extra_state"]["step"] == 4  # the save left pending at exit committed first
