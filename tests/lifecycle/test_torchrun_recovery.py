"""Every-step memory-tier saves under torchrun's own restarts (``examples/every_step_torchrun.py``):
a rank SIGKILLed at a random step costs at most one step. torchrun (``--max-restarts=1``) starts the
workers again, they load the newest committed generation from the nodes' folders (2 or 4 ranks
posing as 2 nodes) and continue; their losses equal, bit for bit, those of the same job run without a fault,
from the step after the loaded one. With the killed rank's node folder removed before the restart,
the generation comes from the peer node's copy.

Each job is torchrun itself, a fresh process leading its own process group; the test reads the
workers' lines as they come and kills the victim when it has printed the chosen step."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

from process_checks import own_process_group

pytestmark = pytest.mark.distributed  # torchrun's worker processes, outside the rank pool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_recovery_job.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
STEPS = 35
JOB_LIMIT_S = 120  # a job has hung if it has not ended by then
VICTIM = 1
STEP_LINE = re.compile(r"\[rank (\d+)\] step (\d+) loss (\S+)")


class Torchrun:
    """``torchrun --max-restarts=1`` of the job script on one of the ways torchrun hands the workers
    a store (``rendezvous``), its output read as it comes; calls ``on_line`` with each line (from the
    reading thread)."""

    def __init__(self, tier_dir: str, nprocs: int, nodes: str, *extra: str, rendezvous: str = "own-store",
                 on_line=None) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        launcher = ["--standalone"]  # c10d rendezvous, the agent's store shared by every attempt
        if rendezvous == "own-store":  # c10d rendezvous, a store for each attempt
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        elif rendezvous == "static":  # the store at --master-port, the agent's for the whole run
            launcher = ["--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
                        "--nnodes=1", "--node-rank=0"]
        command = [TORCHRUN, *launcher, f"--nproc-per-node={nprocs}", "--max-restarts=1", "--monitor-interval=0.1",
                   JOB, "--tier-dir", tier_dir, "--nodes", nodes, "--steps", str(STEPS), *extra]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=ROOT, **own_process_group())
        self.lines: list[str] = []
        self._on_line = on_line
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self._on_line:
                self._on_line(line)

    def finish(self) -> tuple[int, str]:
        try:
            code = self.proc.wait(JOB_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            code = None
        self._reader.join(10)
        output = "".join(self.lines)
        assert code is not None, f"torchrun did not end within {JOB_LIMIT_S}s:\n{output}"
        return code, output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(lines: list[str]) -> dict[int, dict[int, str]]:
    """Each rank's loss (float.hex) of each step printed in ``lines``."""
    found: dict[int, dict[int, str]] = {}
    for rank, step, loss in STEP_LINE.findall("".join(lines)):
        found.setdefault(int(rank), {})[int(step)] = loss
    return found


def attempts(output: str) -> list[list[str]]:
    """The workers' lines of each attempt (torchrun restarts them all): a rank's lines belong to the
    attempt it announced last."""
    parts: list[list[str]] = []
    current: dict[str, int] = {}
    for line in output.splitlines(keepends=True):
        rank = re.match(r"\[rank (\d+)\]", line)
        if not rank:
            continue
        if started := re.match(r"\[rank \d+\] attempt (\d+) pid", line):
            current[rank.group(1)] = int(started.group(1))
        attempt = current.get(rank.group(1), 0)
        parts.extend([] for _ in range(attempt + 1 - len(parts)))
        parts[attempt].append(line)
    return parts


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The global loss of each step of the job run without a fault on ``nodes`` (every rank prints it)."""
    runs: dict[str, dict[int, str]] = {}

    def of(nodes: str) -> dict[int, str]:
        if nodes not in runs:
            world = len(nodes.split(","))
            code, output = Torchrun(str(tmp_path_factory.mktemp("reference")), world, nodes).finish()
            assert code == 0, output
            per_rank = losses(attempts(output)[0])
            assert sorted(per_rank) == list(range(world)), output
            assert all(steps == per_rank[0] and len(steps) == STEPS for steps in per_rank.values()), output
            runs[nodes] = per_rank[0]
        return runs[nodes]

    return of


def run_killed(tier_dir: str, nodes: str, rendezvous: str, kill_at: int, *extra: str) -> str:
    """The job with rank ``VICTIM`` SIGKILLed as soon as it has printed step ``kill_at``; its output."""
    victim_pid: list[int] = []
    killed = threading.Event()

    def on_line(line: str) -> None:
        if m := re.match(rf"\[rank {VICTIM}\] attempt 0 pid (\d+)", line):
            victim_pid.append(int(m.group(1)))
        m = STEP_LINE.match(line)
        if m and int(m.group(1)) == VICTIM and int(m.group(2)) == kill_at and not killed.is_set():
            with contextlib.suppress(ProcessLookupError):  # it ended already: the assertion below says so
                os.kill(victim_pid[0], signal.SIGKILL)
                killed.set()

    code, output = Torchrun(tier_dir, len(nodes.split(",")), nodes, *extra, rendezvous=rendezvous,
                            on_line=on_line).finish()
    assert killed.is_set(), f"rank {VICTIM} never printed step {kill_at} or ended before the kill:\n{output}"
    # torchrun succeeds only where every worker of its last attempt exited 0; the first attempt
    # ended by the kill, which the agent saw as the victim's SIGKILL.
    assert code == 0, output
    assert re.search(rf"failed \(exitcode: -9\) local_rank: {VICTIM}", output), output
    return output


def check_recovery(output: str, reference: dict[int, str]) -> None:
    """At most one step repeated, and the resumed losses equal the reference's bitwise."""
    assert len(attempts(output)) == 2, output
    first, second = attempts(output)
    before = losses(first)
    last_done = max(max(steps) for steps in before.values())
    resumed = re.findall(r"\[rank (\d+)\] resumed after step (\d+) from generation (\d+) \((\w+)\)", "".join(second))
    assert len(resumed) == len(before) and len({r[1:] for r in resumed}) == 1, output
    loaded_step = int(resumed[0][1])
    assert resumed[0][3] == "memory", output
    assert last_done - 1 <= loaded_step <= last_done, f"printed up to step {last_done}, resumed after {loaded_step}"
    for rank, steps in before.items():  # before the kill: the same training as the reference
        assert steps == {s: reference[s] for s in steps}, f"rank {rank} before the kill"
    after = losses(second)
    for rank in before:
        want = {s: reference[s] for s in range(loaded_step + 1, STEPS + 1)}
        assert after[rank] == want, f"rank {rank} after resuming from step {loaded_step}:\n{output}"


# Each way torchrun can hand the workers a store (examples/every_step_torchrun.py's init_process_group):
# a store per attempt (c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), the agent's for the whole run
# (static; c10d by default), where the example keys the process group by the attempt.
@pytest.mark.parametrize("nodes, lose_folder, rendezvous", [("a,b", False, "own-store"), ("a,b", True, "static"),
                                                            ("a,a,b,b", True, "shared-store")],
                         ids=["2-nodes-own-folders", "2-nodes-peer-copy-static", "4-ranks-on-2-nodes-peer-copy"])
def test_a_rank_killed_at_a_random_step_costs_at_most_one_step(tmp_path, reference, nodes, lose_folder, rendezvous):
    kill_at = random.Random().randint(2, STEPS - 25)
    lost = nodes.split(",")[VICTIM]
    extra = ("--lose-node", lost) if lose_folder else ()
    output = run_killed(str(tmp_path / "tier"), nodes, rendezvous, kill_at, *extra)
    check_recovery(output, reference(nodes))
    if lose_folder:
        assert f"removed the folder of node {lost}\n" in output, output
