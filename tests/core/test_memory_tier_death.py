"""A rank SIGKILLed during a memory-tier save (2 ranks as 2 nodes, processes of this test's own; sync,
and async, where the copies are made on the background lane): the survivor fails with a
``DistributedError`` instead of hanging, and a fresh job then loads a whole generation from the
tier, never a partial one: the previous one when the victim died before any node marked the new
one, the new one when it died after its peer marked it (every copy had been made by then, so the
survivor's folder holds all of it)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import signal
import socket

import pytest
import torch
import torch.distributed as dist

import bcp
import bcp.tier.local
import bcp.tier.replication
from dying_coordinator import die, reap

pytestmark = pytest.mark.distributed  # processes of its own, outside the rank pool

TIMEOUT_S = 3.0  # the process group's timeout, hence the coordinator's
CASE_LIMIT_S = 60  # a rank has hung if it has not answered by then
VICTIM = 1


def _tier(root: str) -> bcp.MemoryTier:
    return bcp.MemoryTier(os.path.join(root, "persistent"), local_dir=os.path.join(root, "tier"), nodes=["a", "b"])


def _state(value: float, rank: int) -> dict:
    return {"model": {"w": torch.full((1000,), value)}, "extra_state": {"saved": value, "rank": rank}}


def rank_main(rank: int, port: int, root: str, job: str, async_save: bool, answers: "mp.Queue") -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    if job == "load":
        state = _state(0.0, rank)
        result = bcp.load(_tier(root), state)
        saved = state["extra_state"]["saved"]
        answers.put((rank, result.source, saved, bool((state["model"]["w"] == saved).all())))
        dist.destroy_process_group()
        return
    bcp.save(_tier(root), _state(1.0, rank))  # generation 1, committed on both nodes
    if rank == VICTIM:
        if job == "replicate":  # its files written, before any copy is sent
            bcp.tier.replication.run_transfers = lambda *args, **kwargs: die()
        else:  # "mark": every copy made and agreed, the peer marks, this node does not
            bcp.tier.local.NodeLocation.commit_encoded = lambda *args, **kwargs: die()
    try:
        bcp.save(_tier(root), _state(2.0, rank), async_save=async_save).wait()
        answers.put((rank, "saved", False, ""))
    except Exception as exc:
        answers.put((rank, type(exc).__name__, isinstance(exc, bcp.CheckpointError), str(exc)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(root: str, job: str, answering: int, async_save: bool = False) -> tuple[list, list]:
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, root, job, async_save, answers), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    got = []
    try:
        for _ in range(answering):
            got.append(answers.get(timeout=CASE_LIMIT_S))
    except queue.Empty:
        got.append(("no answer: a rank hung",))
    codes = reap(procs)
    return got, codes


@pytest.mark.parametrize("death,async_save,loads", [("replicate", False, 1.0), ("mark", False, 2.0),
                                                   ("replicate", True, 1.0)])
def test_a_rank_killed_during_a_tier_save_leaves_a_whole_generation(tmp_path, death, async_save, loads):
    got, codes = _run(str(tmp_path), death, 1, async_save)
    assert codes[VICTIM] == -signal.SIGKILL, f"the victim did not die as planned: {codes}, {got}"
    (survivor, kind, is_checkpoint_error, message), = got
    assert survivor == 1 - VICTIM and kind == "DistributedError" and is_checkpoint_error, got
    got, codes = _run(str(tmp_path), "load", 2)
    assert codes == [0, 0], (codes, got)
    for rank, source, saved, whole in got:
        assert source == "memory" and saved == loads and whole, got
