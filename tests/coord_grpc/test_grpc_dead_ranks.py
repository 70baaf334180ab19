"""A dead or hung rank ends the exchange on every surviving rank within the timeout, with an error
that names it, its machine and the exchange, and, in a save, the phase of the save it interrupted;
nothing waits forever."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
from dying_coordinator import Dying, die
from grpc_nodes import close_all, on_threads, start_nodes

import bcp
from bcp.coord.grpc import GrpcCoordinator

TIMEOUT_S = 6.0
JOIN_S = 120  # a guard against a hang, not a timing assertion


def binary_tree_of_four(namespace: str) -> list[GrpcCoordinator]:
    """0 -> (1, 2), 1 -> 3: one machine per rank, two children per leader."""
    return start_nodes(4, namespace, timeout=TIMEOUT_S, ranks_per_machine=1, fan_out=2)


@pytest.mark.parametrize("hung", [3, 1], ids=["leaf", "inner node"])
def test_a_hung_rank_is_named_on_every_other_rank(hung):
    nodes = binary_tree_of_four(f"hung-{hung}")
    try:
        results = on_threads(4, lambda r: None if r == hung else nodes[r].all_gather_bytes(b"x"))
    finally:
        close_all(nodes)
    for rank, result in enumerate(results):
        if rank == hung:
            continue
        assert isinstance(result, bcp.DistributedError), (rank, result)
        assert f"rank {hung} on {socket.gethostname()}" in str(result)
        assert "exchange 0 (all_gather)" in str(result)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def survivors_reports(target, world: int, victim: int, args: tuple) -> dict[int, str]:
    """Runs ``target(rank, *args, report)`` in a process per rank; what the survivors reported
    (rank -> message), once the victim was seen killed."""
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, report)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        reports = dict(report.get(timeout=JOIN_S) for _ in range(world - 1))
    finally:
        for p in procs:
            p.join(timeout=JOIN_S)
            if p.is_alive():
                p.kill()
    assert procs[victim].exitcode == -signal.SIGKILL
    return reports


def dying_rank(rank: int, world: int, port: int, victim: int, report) -> None:
    """A process of the job (no process group: it meets through MASTER_ADDR/MASTER_PORT). After a
    good exchange, ``victim`` is killed while it waits inside the next one for its child."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        coordinator = GrpcCoordinator(timeout=TIMEOUT_S, ranks_per_machine=1, fan_out=2)
        coordinator.all_gather_bytes(b"warm")
        if rank == victim:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
        elif rank in coordinator.tree.children(victim):
            time.sleep(1.0)  # so that the victim dies waiting for this child, mid-exchange
        coordinator.gather_bytes(b"plan")
        report.put((rank, "no error"))
    except bcp.DistributedError as exc:
        report.put((rank, str(exc)))
    except BaseException as exc:  # anything else is a failure of the test: say what
        report.put((rank, f"unexpected {exc!r}"))


def test_a_rank_killed_mid_exchange_is_named_on_every_survivor():
    world, victim, port = 4, 1, free_port()
    reports = survivors_reports(dying_rank, world, victim, (world, port, victim))
    assert sorted(reports) == [0, 2, 3]
    for rank, message in reports.items():
        assert f"rank {victim} on {socket.gethostname()}" in message, (rank, message)
        assert "exchange 1 (gather)" in message, (rank, message)


def saving_rank(rank: int, port: int, path: str, victim: int, death: int | str, async_save: bool, report) -> None:
    """A rank of a 2-rank job saving over the gRPC tree. ``victim`` dies at its ``death``-th
    exchange (``"background N"``: its background channel's N-th) once both trees are up, or before
    making its coordinator (``"before"``), or while making its background one (``"sibling"``)."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    state = {"model": {"w": torch.arange(64.0)}, "extra_state": {"rank": rank}}
    store.set(f"ready/{rank}", b"")
    store.wait(["ready/0", "ready/1"])
    if rank == victim:  # a victim hosting the store (rank 0) lets the survivor's wait end first
        store.wait([f"past/{1 - victim}"])
    else:
        store.set(f"past/{rank}", b"")
    try:
        if rank == victim and death == "before":
            die()
        coordinator = GrpcCoordinator(timeout=TIMEOUT_S, ranks_per_machine=1, fan_out=2)
        if death != "sibling":
            coordinator.sibling()
        if rank == victim:
            background = death if death == "sibling" else int(death.split()[1]) if isinstance(death, str) else None
            coordinator = Dying(coordinator, None if background else death, background)
        bcp.save(path, state, coordinator=coordinator, async_save=async_save).wait()
        report.put((rank, "no error"))
    except bcp.DistributedError as exc:
        report.put((rank, str(exc)))
    except BaseException as exc:  # anything else is a failure of the test: say what
        report.put((rank, f"unexpected {exc!r}"))


HOST = socket.gethostname()
# (victim, death, async) -> the phase the survivor's error must begin with, and how it names the
# victim. A first save plans with 3 exchanges (agree, gather, scatter), then its commit barrier takes
# 2 (reports up, verdict down); an asynchronous save's barrier runs on its background channel.
SAVE_DEATHS = {
    (1, "before", False): ("setting up checkpoint coordination (channel 'plan')", "rank 1's address"),
    (1, 1, False): ("planning the save of", f"rank 1 on {HOST}"),
    (0, 2, False): ("planning the save of", f"rank 0 on {HOST}"),
    (0, 4, False): ("writing the checkpoint", f"rank 0 on {HOST}"),
    (1, "sibling", True): ("setting up checkpoint coordination (channel 'plan/background')", "rank 1's address"),
    (1, "background 1", True): ("writing the checkpoint", f"rank 1 on {HOST}"),
}


@pytest.mark.parametrize("victim,death,async_save", list(SAVE_DEATHS),
                         ids=[f"rank{v}-{'async' if a else 'sync'}-{d}" for v, d, a in SAVE_DEATHS])
def test_a_rank_killed_in_a_save_is_named_with_the_phase_on_the_survivor(memory_dir, victim, death, async_save):
    # In memory, so that a stalled durable write cannot pass for a dead rank within the short timeout.
    reports = survivors_reports(saving_rank, 2, victim, (free_port(), f"{memory_dir}/ckpt", victim, death,
                                                         async_save))
    assert list(reports) == [1 - victim]
    message = reports[1 - victim]
    phase, victim_named = SAVE_DEATHS[victim, death, async_save]
    assert message.startswith(phase), message
    assert victim_named in message, message
