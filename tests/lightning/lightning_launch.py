"""Launching Lightning jobs for the tests: ``run(n, cases, workdir)`` starts ``n`` processes of
``lightning_worker.py`` and returns each rank's results.

Lightning's Trainer creates its own process group, so these runs cannot share the session's rank
pool. Each process gets the variables Lightning reads for processes launched from outside (as a
cluster scheduler would start them): ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``. A job that does not finish in ``TIMEOUT_S`` is killed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import torch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_worker.py")
TIMEOUT_S = 420


def run(world_size: int, cases: list[dict[str, Any]], workdir: str) -> list[list[Any]]:
    """Run ``cases`` (``{"case": name, "args": {...}}``) in order on ``world_size`` ranks; returns
    ``results[rank][case]``."""
    os.makedirs(workdir, exist_ok=True)
    spec = os.path.join(workdir, "spec.json")
    with open(spec, "w") as f:
        json.dump({"cases": cases, "out": workdir}, f)
    port = _free_port()
    logs = [open(os.path.join(workdir, f"rank-{r}.log"), "w+") for r in range(world_size)]
    procs = [subprocess.Popen([sys.executable, WORKER, spec], env=_env(r, world_size, port), stdout=log,
                              stderr=subprocess.STDOUT, cwd=workdir) for r, log in enumerate(logs)]
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        raise AssertionError(f"Lightning job did not finish in {TIMEOUT_S}s:\n{_tails(logs)}") from None
    finally:
        for log in logs:
            log.flush()
    if any(codes):
        raise AssertionError(f"Lightning job failed (exit codes {codes}):\n{_tails(logs)}")
    for log in logs:
        log.close()
    return [torch.load(os.path.join(workdir, f"result-{r}.pt"), weights_only=True) for r in range(world_size)]


def _env(rank: int, world_size: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")}
    env.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tails(logs: list[Any], lines: int = 40) -> str:
    out = []
    for rank, log in enumerate(logs):
        log.seek(0)
        out.append(f"--- rank {rank} ---\n" + "".join(log.readlines()[-lines:]))
        log.close()
    return "\n".join(out)
