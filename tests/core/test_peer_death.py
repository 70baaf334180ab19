"""A rank killed during a save (a real process, SIGKILL at a chosen point of a 2-rank save, sync
or async) makes the survivor raise a ``DistributedError`` naming the phase and the dead rank,
within the timeout and a short grace: never torch's own error, never a hang.

The ranks are processes of this test's own, on a TCPStore hosted by rank 0 (so killing rank 0
takes the store down too): the shared rank pool cannot lose a rank. The dying rank runs the real
coordinator behind a wrapper that only chooses the moment of death.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import signal
import socket

import pytest
import torch
import torch.distributed as dist

import bcp
from dying_coordinator import Dying, die, reap

pytestmark = pytest.mark.distributed  # processes of its own, outside the rank pool

TIMEOUT_S = 3.0  # the process group's timeout, hence the coordinator's
CASE_LIMIT_S = 120  # the survivor has hung if it has not answered by then


# phase -> (the victim's death point, the survivor's error must name) ; a first save plans with
# 3 exchanges (agree, gather, scatter), then commits with 2 (gather, scatter).
SYNC = {
    "setup": ("before", "setting up checkpoint coordination (channel 'plan')"),
    "plan": (1, "planning the save of"),
    "commit": (4, "writing the checkpoint"),
}
ASYNC = {
    "setup": ("before", "setting up checkpoint coordination (channel 'plan')"),
    "plan": (1, "planning the save of"),
    "background setup": ("sibling", "setting up checkpoint coordination (channel 'plan/background')"),
    "commit": ("background 1", "writing the checkpoint"),
}


def rank_main(rank: int, port: int, path: str, victim: int, death: int | str, async_save: bool,
              answers: "mp.Queue") -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    state = {"model": {"w": torch.arange(64.0)}, "extra_state": {"rank": rank}}
    # Channels set up beforehand, unless their setup is the phase under test: the victim then dies
    # only once every rank is past them (a rank finishes gloo's rendezvous before its peers do).
    if death == "sibling":
        bcp.TorchCoordinator()
    elif death != "before":
        bcp.TorchCoordinator().sibling()
    store.set(f"ready/{rank}", b"")
    store.wait(["ready/0", "ready/1"])  # start together: the short timeout then measures the death only
    # The survivor says it is past that wait before the victim may die: a victim hosting the store
    # (rank 0) would otherwise take it down while the survivor's wait is still being answered.
    if rank == victim:
        store.wait([f"past/{1 - victim}"])
    else:
        store.set(f"past/{rank}", b"")
    if rank == victim:
        if death == "before":
            die()
        if death == "sibling":
            coordinator = Dying(bcp.TorchCoordinator(), None, "sibling")
        elif isinstance(death, str):  # "background N"
            coordinator = Dying(bcp.TorchCoordinator(), None, int(death.split()[1]))
        else:
            coordinator = Dying(bcp.TorchCoordinator(), death)
        bcp.save(path, state, coordinator=coordinator, async_save=async_save).wait()
        answers.put(("victim survived", False, ""))
        return
    try:
        bcp.save(path, state, async_save=async_save).wait()
        answers.put(("saved", False, ""))
    except Exception as exc:
        answers.put((type(exc).__name__, isinstance(exc, bcp.CheckpointError), str(exc)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(path: str, victim: int, death: int | str, async_save: bool) -> tuple[tuple, list]:
    """The survivor's answer, and both processes' exit codes."""
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, path, victim, death, async_save, answers), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        answer = answers.get(timeout=CASE_LIMIT_S)
    except queue.Empty:
        answer = ("no answer: the survivor hung", False, "")
    codes = reap(procs)
    return answer, codes


CASES = ([(v, "sync", phase) for v in (1, 0) for phase in SYNC]
         + [(v, "async", phase) for v in (1, 0) for phase in ASYNC if v == 1 or phase in ("plan", "commit")])


@pytest.mark.parametrize("victim,mode,phase", CASES, ids=[f"rank{v}-{m}-{p}" for v, m, p in CASES])
def test_peer_death_is_a_checkpoint_error_naming_phase_and_rank(memory_dir, victim, mode, phase):
    death, names = (SYNC if mode == "sync" else ASYNC)[phase]
    # In memory: on a loaded disk, rank 0's durable claim of the generation can stall past the timeout.
    (kind, is_checkpoint_error, message), codes = run_case(f"{memory_dir}/ckpt", victim, death, mode == "async")
    assert codes[victim] == -signal.SIGKILL, f"the victim did not die as planned: {codes}, {kind}: {message}"
    assert codes[1 - victim] == 0, f"the survivor did not exit cleanly: {codes}"
    assert kind == "DistributedError" and is_checkpoint_error, f"{kind}: {message}"
    assert names in message, message
    assert f"no report from rank(s) {victim} " in message, message
