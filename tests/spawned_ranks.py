"""Gloo ranks for loaders with read-worker processes: ``run(world, fn, *args)`` starts ``world``
fresh processes with ``torch.multiprocessing.spawn``, calls ``fn(*args)`` on each inside its
process group and returns the per-rank results.

A DataLoader's worker processes cannot be children of the daemonic ranks of the session's pool
(tests/pool.py), hence these short-lived ones.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import socket
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

PG_TIMEOUT_S = 60


def _rank_main(rank: int, world: int, port: int, folder: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    # a spawned process inherits the spawn start method, and a loader's workers would then each
    # import torch anew (seconds apiece); forked they start at once
    multiprocessing.set_start_method("fork", force=True)
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
        torch_mp.spawn(_rank_main, args=(world, port, folder, fn, args), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(folder, f"result-{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    for kind, value in results:
        if kind == "error":
            raise value
    return [value for _, value in results]
