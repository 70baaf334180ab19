"""Fresh rank processes in a fraction of a second: a zygote that has imported torch and bcp once
forks the ranks of each job.

The rank pools never exit between cases, so they cannot see what happens when a user's process
ends. Here every rank is a process of its own that runs one job and then leaves the way a
training script does: its function returns (or raises, or calls ``sys.exit``) and the interpreter
shuts down normally — thread-exit hooks, ``atexit``, module teardown. The zygote reports each
rank's exit code, or the signal that killed it. Forking from a process that already imported
torch takes milliseconds where a new interpreter takes seconds, so a test can run dozens of jobs.

Run as a script it serves requests on stdin (one JSON object per line) and answers on stdout;
tests drive it through :class:`Zygote`.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
#: Asks a rank that outlived its job's timeout for its threads' stacks (faulthandler), before it is killed.
STACKS_SIGNAL = signal.SIGUSR1
STACKS_WAIT_S = 2.0


@dataclass
class RankExit:
    """How one rank process ended: ``code`` (exit status) or ``signal`` (what killed it)."""

    rank: int
    code: int | None
    signal: int | None
    output: str

    @property
    def clean(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        how = f"exit code {self.code}" if self.signal is None else f"killed by {signal.Signals(self.signal).name}"
        return f"rank {self.rank}: {how}\n{self.output[-6000:]}"


@dataclass
class JobExit:
    ranks: list[RankExit]
    timed_out: bool

    @property
    def clean(self) -> bool:
        return not self.timed_out and all(r.clean for r in self.ranks)

    def describe(self) -> str:
        head = ("timed out: every rank still running was asked for its threads' stacks (in its output below), "
                "then killed\n" if self.timed_out else "")
        return head + "\n".join(r.describe() for r in self.ranks)


class Zygote:
    """A zygote process serving jobs; ``preload`` names extra modules it imports once."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *preload], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE)
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the zygote did not start: {ready!r}")

    def run(self, job: str, world: int, *args: Any, timeout: float = 180.0,
            env: dict[str, str] | None = None) -> JobExit:
        """Runs ``job`` (``"module:function"``, importable from this folder) on ``world`` fresh
        rank processes with ``args``; returns how each rank ended. The default ``timeout`` outlasts
        ``lifecycle_jobs.JOB_GROUP_TIMEOUT_S`` (the process-group timeout of the jobs there), so a rank
        stuck in an exchange fails with bcp's own message before this timeout kills it."""
        request = {"job": job, "world": world, "args": list(args), "timeout": timeout, "env": env or {}}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline()
        if not answer:
            raise RuntimeError("the zygote died")
        reply = json.loads(answer)
        return JobExit([RankExit(**r) for r in reply["ranks"]], reply["timed_out"])

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=30)


# ---------------------------------------------------------------------------- the zygote's side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _become_rank(request: dict[str, Any], rank: int, port: int, log: str) -> None:
    """In the forked child: become rank ``rank`` and run the job. Returning (or raising) leaves
    through the zygote's own top level, so the interpreter shuts down as a script's would."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # a job that hangs says where, in its log
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    world = request["world"]
    os.environ.update(request["env"])
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", GROUP_RANK="0")
    module, name = request["job"].split(":")
    getattr(importlib.import_module(module), name)(*request["args"])


def _wait(pids: list[int], timeout: float) -> tuple[list[int], bool]:
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(statuses) < len(pids):
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = status
        if len(statuses) < len(pids):
            if time.monotonic() > deadline:
                hung = [pid for pid in pids if pid not in statuses]
                for pid in hung:
                    os.kill(pid, STACKS_SIGNAL)
                time.sleep(STACKS_WAIT_S)
                for pid in hung:
                    os.kill(pid, signal.SIGKILL)
                    statuses[pid] = os.waitpid(pid, 0)[1]
                return [statuses[p] for p in pids], True
            time.sleep(0.01)
    return [statuses[p] for p in pids], False


def _serve() -> bool:
    """Serves requests until stdin closes. Returns True in a forked rank (which then leaves)."""
    for line in sys.stdin:
        request = json.loads(line)
        port = _free_port()
        logs = [tempfile.mktemp(prefix=f"rank{r}-", suffix=".log") for r in range(request["world"])]
        sys.stdout.flush()
        pids = []
        for rank, log in enumerate(logs):
            pid = os.fork()
            if pid == 0:
                _become_rank(request, rank, port, log)
                return True
            pids.append(pid)
        statuses, timed_out = _wait(pids, request["timeout"])
        ranks = []
        for rank, (status, log) in enumerate(zip(statuses, logs)):
            with open(log, errors="replace") as f:
                output = f.read()
            os.unlink(log)
            ranks.append({"rank": rank, "output": output,
                          "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                          "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None})
        print(json.dumps({"ranks": ranks, "timed_out": timed_out}), flush=True)
    return False


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.path.insert(1, os.path.dirname(HERE))
    import torch  # noqa: F401  (everything a job needs, imported once before any fork)
    import torch.distributed  # noqa: F401
    import torch._dynamo  # noqa: F401  (FSDP2 imports it on first use: a second per rank)
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import bcp  # noqa: F401

    for extra in sys.argv[1:]:
        importlib.import_module(extra)
    torch.set_num_threads(1)
    # Copy-on-write: without this a rank's exit-time collections touch every page the zygote's
    # imports made, and a bare exit takes over a second.
    if not os.environ.get("NOFREEZE"): gc.freeze()
    print("ready", flush=True)
    _serve()
