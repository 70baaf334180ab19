"""A dead or hung rank ends the exchange on every surviving rank within the timeout, with an error
that names it, its machine and the exchange; nothing waits forever."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import pytest
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
    world, victim = 4, 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    procs = [ctx.Process(target=dying_rank, args=(r, world, port, victim, report)) for r in range(world)]
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
    assert sorted(reports) == [0, 2, 3]
    for rank, message in reports.items():
        assert f"rank {victim} on {socket.gethostname()}" in message, (rank, message)
        assert "exchange 1 (gather)" in message, (rank, message)
