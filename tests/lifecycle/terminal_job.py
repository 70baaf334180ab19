"""A 2-rank training job as a user runs it from a terminal: ``python terminal_job.py PATH``.

The tests start it leading a process group of its own and send their Ctrl-C to that whole group
(``os.killpg``), as a terminal sends it to its foreground job: the launcher,
both ranks and their writer processes all receive it. The launcher ignores it, as a launcher that
outlives its ranks does; each rank gets Python's KeyboardInterrupt.

Each rank saves generation 1 (sync) and 2 (async, waited), which starts its writer process, then
stops that process (SIGSTOP) and hands it generation 3, a save that so stays pending until the test
lets the writer process go on (SIGCONT): whatever the test does meanwhile happens while the save is
pending, at no particular point of its writes. The rank then trains until interrupted.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import bcp
from bcp.integration import runtime

WORLD = 2


def _say(line: str) -> None:
    """One write per line: both ranks share the launcher's stdout, and print() writes a line's end
    apart where Python's output is unbuffered (PYTHONUNBUFFERED), so two ranks' lines could run together."""
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def model(value: float) -> nn.Module:
    """32 MB of parameters, every one ``value``: the pending save has pieces to write."""
    module = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8)))
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.fill_(value)
    return module


def _rank(path: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    bcp.save(path, {"model": model(1.0)})
    bcp.save(path, {"model": model(2.0)}, async_save=True).wait()
    writer = runtime().background.writer_pid()
    os.kill(writer, signal.SIGSTOP)
    bcp.save(path, {"model": model(3.0)}, async_save=True)
    _say(f"rank {rank}: writer process {writer} stopped; training")
    while True:
        time.sleep(0.05)


def _launch(path: str) -> bool:
    """Forks the ranks; True in a rank (which then leaves through the interpreter's normal exit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                              LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
            _rank(path)
            return True
        pids.append(pid)
    for rank, pid in enumerate(pids):
        status = os.waitpid(pid, 0)[1]
        how = (f"exit code {os.WEXITSTATUS(status)}" if os.WIFEXITED(status)
               else f"signal {signal.Signals(os.WTERMSIG(status)).name}")
        _say(f"rank {rank} ended: {how}")
    return False


if __name__ == "__main__":
    torch.set_num_threads(1)
    _launch(sys.argv[1])
