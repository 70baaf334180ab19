"""Worker processes: ``launch(fn, world, config)`` runs ``fn(config)`` on ``world`` fresh spawned
processes (a gloo group when ``world > 1``) and returns rank 0's result. Fresh processes keep each
group of cases' memory figures clean and let the cases own their process groups."""

from __future__ import annotations

import datetime
import importlib
import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

PG_TIMEOUT_S = 900  # a rank may wait at a barrier while another writes gigabytes to a slow disk


class WorkerFailed(RuntimeError):
    pass


def launch(fn: Callable[[dict], dict], world: int, config: dict[str, Any], timeout_s: float) -> dict:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bcp-bench-result-") as out:
        port = _free_port()
        target = f"{fn.__module__}:{fn.__name__}"
        procs = [ctx.Process(target=_entry, args=(target, rank, world, port, config, out)) for rank in range(world)]
        for p in procs:
            p.start()
        try:
            _wait(procs, time.monotonic() + timeout_s)
        finally:
            hung = [p for p in procs if p.is_alive()]
            for p in hung:
                p.kill()
                p.join()
        errors = [_read(os.path.join(out, name)) for name in sorted(os.listdir(out)) if name.endswith(".err")]
        if hung or errors or any(p.exitcode for p in procs):
            reason = f"timed out after {timeout_s:.0f}s" if hung and not errors else "failed"
            raise WorkerFailed(f"{target} on {world} process(es) {reason}\n" + "\n".join(errors))
        with open(os.path.join(out, "rank0.json")) as f:
            return json.load(f)


def _wait(procs: list, deadline: float) -> None:
    """Until all exit, the deadline passes, or one fails (its peers would only hang at the next
    collective until the group's timeout)."""
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if any(p.exitcode for p in procs):
            return
        time.sleep(0.2)


def _entry(target: str, rank: int, world: int, port: int, config: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    # torch's notices about its own deprecated internals (FSDP1, ShardedTensor, no process group)
    # repeat on every save and would bury the progress lines.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.")
    try:
        import torch
        import torch.distributed as dist

        if world > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        module, name = target.split(":")
        result = getattr(importlib.import_module(module), name)(config)
        if rank == 0:
            with open(os.path.join(out, "rank0.json"), "w") as f:
                json.dump(result, f)
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - whatever stops a rank, the parent gets its traceback
        with open(os.path.join(out, f"rank{rank}.err"), "w") as f:
            f.write(f"rank {rank}:\n{traceback.format_exc()}")
        raise SystemExit(1)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
