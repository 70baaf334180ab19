"""Launching Lightning jobs for the tests: ``run(n, cases, workdir)`` starts ``n`` processes of
``lightning_worker.py`` and returns each rank's results.

Lightning's Trainer creates its own process group, so these runs cannot share the session's rank
pool. Each process gets the variables Lightning reads for processes launched from outside (as a
cluster scheduler would start them): ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``. A job that does not finish in ``TIMEOUT_S`` is killed, every
process of it (the ranks and their dataloader workers) first asked to write its threads' stacks
into its log; when one rank fails, the others are killed at once rather than left waiting for it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import torch

from process_checks import own_process_group

HERE = os.path.dirname(os.path.abspath(__file__))
#: Each rank runs ``lightning_worker.main()`` from ``-c``, not the file as a script: a process's loader
#: workers (started from a fork server) import the script that is ``__main__`` anew, and this one
#: imports Lightning (4 s apiece); a ``-c`` main is not imported again, so the fork server preloads
#: torch alone.
WORKER = [sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r}); import lightning_worker; "
                                "lightning_worker.main()"]
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
    # Each rank leads a process group of its own, with its dataloader workers, so that all of them
    # can be signalled and killed together.
    procs = [subprocess.Popen([*WORKER, spec], env=_env(r, world_size, port), stdout=log,
                              stderr=subprocess.STDOUT, cwd=workdir, **own_process_group())
             for r, log in enumerate(logs)]
    try:
        codes = _wait(procs)
    finally:
        for p in procs:
            _signal_group(p, signal.SIGKILL)
            p.wait()
        for log in logs:
            log.flush()
    if codes is None:
        raise AssertionError(f"Lightning job did not finish in {TIMEOUT_S}s:\n{_tails(logs)}")
    if any(codes):
        raise AssertionError(f"Lightning job failed (exit codes {codes}):\n{_tails(logs)}")
    for log in logs:
        log.close()
    return [torch.load(os.path.join(workdir, f"result-{r}.pt"), weights_only=True) for r in range(world_size)]


def _wait(procs: list[subprocess.Popen]) -> list[int | None] | None:
    """Every rank's exit code once all ended or one failed (the others' then None); None after
    ``TIMEOUT_S``, when every process has been asked for its stacks (the workers' faulthandler)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(code is not None for code in codes) or any(codes):
            return codes
        time.sleep(0.2)
    for p in procs:
        _signal_group(p, signal.SIGUSR2)
    time.sleep(3)  # time to write the stacks
    return None


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass  # the group has ended


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
