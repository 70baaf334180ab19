"""Gloo ranks for loaders with read-worker processes: ``run(world, fn, *args)`` starts ``world``
fresh processes with ``torch.multiprocessing.spawn``, calls ``fn(*args)`` on each inside its
process group and returns the per-rank results.

A DataLoader's worker processes cannot be children of the daemonic ranks of the session's pool
(tests/pool.py), hence these short-lived ones. Their loaders' workers start from a fork server
(``loader_workers``) that has imported the modules of ``fn`` and of the functions among ``args``.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import socket
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

import loader_workers

PG_TIMEOUT_S = 60
#: A job whose ranks have not all finished by then is a hang: each rank still running is asked for
#: its threads' stacks (faulthandler, to stderr, which the test's report shows), then killed.
JOB_TIMEOUT_S = 300
STACKS_SIGNAL = signal.SIGUSR1


def _rank_main(rank: int, world: int, port: int, folder: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    # a spawned process inherits the spawn start method, and a loader's workers would then each
    # import torch anew (seconds apiece)
    loader_workers.start_from_fork_server(*sorted({f.__module__ for f in (fn, *args) if callable(f)}))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        try:
            result = ("ok", fn(*args))
        except Exception as error:  # handed to the test, which re-raises it
            result = ("error", error)
        with open(os.path.join(folder, f"result-{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(*args)`` on ``world`` fresh gloo ranks; an exception raised on a rank is raised here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        ranks = torch_mp.start_processes(_rank_main, args=(world, port, folder, fn, args), nprocs=world, join=False,
                                         start_method="spawn")
        _join_or_name_the_hang(ranks, fn)
        results = []
        for rank in range(world):
            with open(os.path.join(folder, f"result-{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    for kind, value in results:
        if kind == "error":
            raise value
    return [value for _, value in results]


def _join_or_name_the_hang(ranks: torch_mp.ProcessContext, fn: Callable[..., Any]) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not ranks.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() < deadline:
            continue
        hung = [rank for rank, process in enumerate(ranks.processes) if process.is_alive()]
        for rank in hung:
            os.kill(ranks.processes[rank].pid, STACKS_SIGNAL)
        time.sleep(2)
        for process in ranks.processes:
            process.kill()
            process.join()
        raise AssertionError(f"{fn.__module__}.{fn.__name__} did not finish on rank(s) {hung} within "
                             f"{JOB_TIMEOUT_S}s: it hangs (each one's threads' stacks are in the captured stderr)")
