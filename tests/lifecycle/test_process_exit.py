"""Every rank of a job that checkpoints with bcp exits the way its script says, whatever bcp did:
code 0 after a normal return or ``sys.exit(0)``, the script's own error otherwise, never a signal.

The rank pools cannot see this (their workers never exit between cases). Here each job's ranks are
fresh processes forked by a zygote (``zygote.py``) that run one job and leave through the
interpreter's normal shutdown; the README demo runs as the user runs it. A gloo group that bcp
left to the interpreter's final teardown used to abort ranks at exit ("terminate called without an
active exception", SIGABRT) now and then, so each flow runs several times: a job that fails one
time in ten fails this tier almost surely.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from torch import nn

import bcp
from process_checks import gone, kernel_state
from zygote import Zygote

REPEATS = 2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def _expect(result, codes: list[int | None], signals: list[int | None] | None = None) -> None:
    got = [(r.code, r.signal) for r in result.ranks]
    want = list(zip(codes, signals or [None] * len(codes)))
    assert not result.timed_out and got == want, f"wanted {want}, got {got}:\n{result.describe()}"


@pytest.mark.parametrize("mode", ["sync", "async", "async-wait"])
def test_a_save_then_any_ending_exits_as_the_script_says(zygote, tmp_path, mode):
    path = str(tmp_path / "ckpt")
    for repeat in range(REPEATS):
        for how, code in (("return", 0), ("exit", 0), ("raise", 1)):
            for destroy in (True, False):
                result = zygote.run("lifecycle_jobs:save_then_leave", 2, path, mode, how, destroy)
                _expect(result, [code, code])
                if how == "raise":
                    assert all("the training script failed" in r.output for r in result.ranks)
    # Every asynchronous save left pending at exit was committed before the process ended.
    assert bcp.load(path, {"extra_state": None}).generation == REPEATS * 6


@pytest.mark.parametrize("world", [1, 3])
def test_a_resharding_load_then_exit(zygote, tmp_path, world):
    path = str(tmp_path / "ckpt")
    _expect(zygote.run("lifecycle_jobs:save_then_leave", 2, path), [0, 0])
    for repeat in range(REPEATS * 2):
        _expect(zygote.run("lifecycle_jobs:load_then_leave", world, path, "return", repeat % 2 == 0),
                [0] * world)


def test_the_grpc_coordinator_then_exit(zygote, tmp_path):
    for repeat in range(REPEATS):
        _expect(zygote.run("lifecycle_jobs:grpc_save_load_then_leave", 2, str(tmp_path / f"c{repeat}")), [0, 0])


def test_no_thread_or_descriptor_outlives_destroy_process_group(zygote, tmp_path):
    """Cycles of a group created, saved through (sync, async, async left pending), destroyed and
    loaded, then the world destroyed. After 20 cycles the process holds what it holds after one (no
    growth), and exactly the gloo threads and file descriptors of the same job without bcp (bcp's
    gloo groups and background threads used to stay until a later lookup or the interpreter's
    teardown)."""
    def left(cycles: int, use_bcp: bool) -> list[tuple[int, list[str]]]:
        result = zygote.run("lifecycle_jobs:cycles_then_count", 2, str(tmp_path / f"c{cycles}-{use_bcp}"), cycles,
                            use_bcp, 2.0, timeout=240)
        _expect(result, [0, 0])
        return [re.search(r"left: .*", rank.output).group(0) for rank in result.ranks]

    with_bcp = left(20, use_bcp=True)
    assert with_bcp == left(1, use_bcp=True)
    assert with_bcp == left(20, use_bcp=False)


def test_a_second_ctrl_c_abandons_the_pending_save_and_removes_it(zygote, tmp_path):
    path = str(tmp_path / "ckpt")
    result = zygote.run("lifecycle_jobs:interrupted_twice_during_async_save", 2, path, timeout=60)
    _expect(result, [None, None], [signal.SIGINT, signal.SIGINT])  # Python ends on Ctrl-C by SIGINT
    for rank in result.ranks:
        assert "bcp: waiting for 1 asynchronous save(s) to commit" in rank.output, rank.output
        assert "bcp: abandoned 1 asynchronous save(s)" in rank.output, rank.output
        assert "their uncommitted files were removed" in rank.output, rank.output
        assert "runtime.py" not in rank.output, rank.output  # no traceback from bcp's exit hook
    assert not os.path.exists(os.path.join(path, "gen-00000002"))  # every rank abandoned it: removed whole
    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 7))
    assert bcp.load(path, {"model": model, "extra_state": None}).generation == 1


ALONE_IN_AN_EXCHANGE = {
    "torch": r"rank 0 has waited 1s in a checkpoint exchange .* for rank\(s\) 1, which have not reached it: every "
             r"rank of the group must call bcp.save / bcp.load together",
    "grpc": r"rank 0 has waited 1s in exchange 0 \(all_gather\) of the gRPC checkpoint coordinator for rank\(s\) 1, "
            r"which have not reached it: every rank must call bcp.save / bcp.load together"}


@pytest.mark.parametrize("kind", ["torch", "grpc"])
def test_a_save_called_on_rank_0_alone_warns_naming_rank_1(zygote, tmp_path, kind):
    result = zygote.run("lifecycle_jobs:only_rank_zero_saves", 2, str(tmp_path / "ckpt"), 1.0, 4.0, kind, timeout=60)
    assert result.ranks[0].code == 1 and result.ranks[1].code == 0, result.describe()
    out = result.ranks[0].output
    warning = re.search(ALONE_IN_AN_EXCHANGE[kind], out)
    assert warning, out
    assert "DistributedError" in out and out.index(warning.group(0)) < out.index("DistributedError")


ALONE_AT_SETUP = {
    "torch": (r"rank 0 has waited 1s to set up checkpoint coordination over ranks 0-1 \(channel 'plan'\) for "
              r"rank\(s\) 1, which have not called bcp: every rank of the group must call bcp.save / bcp.load "
              r"together",
              r"checkpoint coordination over ranks 0-1 failed while setting up checkpoint coordination \(channel "
              r"'plan'\): no report from rank\(s\) 1 within 5s \(it died, hung or did not call bcp: every rank"),
    "grpc": (r"rank 0 has waited 1s to set up the gRPC checkpoint coordinator for rank 1's address: rank 1 has not "
             r"called bcp. Every rank must call bcp.save / bcp.load together",
             r"setting up checkpoint coordination \(channel 'plan'\) over gRPC failed: rank 1's address did not "
             r"appear in the store within 5s \(rank 1 died, hung or did not call bcp")}


@pytest.mark.parametrize("kind", ["torch", "grpc"])
def test_rank_0_saving_alone_as_the_first_bcp_call_warns_then_fails_within_bcps_timeout(zygote, tmp_path, kind):
    """No coordinator built beforehand: the wait is the setup of bcp's coordination itself, which
    would otherwise wait silently for the process group's timeout (half an hour)."""
    warn_after, timeout = 1.0, 5.0
    env = {"BCP_WARN_AFTER_S": str(warn_after), "BCP_TIMEOUT_S": str(timeout), "BCP_COORDINATOR": kind}
    result = zygote.run("lifecycle_jobs:only_rank_zero_saves_first", 2, str(tmp_path / "ckpt"), timeout + 10,
                        env=env, timeout=90)
    _expect(result, [3, 0])
    out = result.ranks[0].output
    warned, failed = ALONE_AT_SETUP[kind]
    warning = re.search(r"WARNING after ([0-9.]+)s: " + warned, out)
    assert warning, out
    assert warn_after <= float(warning.group(1)) < timeout, out
    error = re.search(r"raised after ([0-9.]+)s: " + failed, out)
    assert error, out
    assert timeout <= float(error.group(1)) < timeout + 10, out  # bcp's timeout, not the process group's


@pytest.mark.parametrize("coordinator", ["torch", "grpc"])
@pytest.mark.parametrize("when", ["before", "during"])
def test_the_store_host_killed_around_side_group_setup_fails_the_survivor_in_time(zygote, when, coordinator):
    timeout = 5.0
    result = zygote.run("lifecycle_jobs:store_host_dies", 2, when, timeout, coordinator, timeout=60)
    _expect(result, [None, 3], [signal.SIGKILL, None])
    survivor = result.ranks[1].output
    seconds = float(re.search(r"raised after ([0-9.]+)s", survivor).group(1))
    assert seconds < timeout + 10, survivor  # the timeout plus the grace for the others' reports
    if "set up without rank 0" not in survivor:  # else the first exchange failed (see the job)
        assert "setting up checkpoint coordination" in survivor, survivor
    assert re.search(r"rank\(s\) 0\b|rank 0's|rank 0 on ", survivor), survivor  # names the dead rank


def test_the_readme_demo_exits_zero_on_every_rank(tmp_path):
    """The README's demo as a user runs it: fresh interpreters spawned by torch.multiprocessing,
    each rank's exit checked by mp.spawn (a rank killed by a signal fails it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"), str(tmp_path / "ckpt")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "demo OK" in done.stdout, done.stdout + done.stderr


def _writer_processes(result) -> list[int]:
    return [int(re.search(r"writer process: (\d+)", rank.output).group(1)) for rank in result.ranks]


@pytest.mark.parametrize("destroy", [True, False])
def test_each_ending_with_the_writer_process_exits_as_the_script_says_and_ends_it(zygote, tmp_path, destroy):
    path = str(tmp_path / "ckpt")
    for how, code in (("return", 0), ("exit", 0), ("raise", 1)):
        result = zygote.run("lifecycle_jobs:writer_process_then_leave", 2, path, how, destroy)
        _expect(result, [code, code])
        assert all(gone(pid) for pid in _writer_processes(result)), result.describe()
    # the save left pending at each exit was committed before the rank ended
    assert bcp.load(path, {"extra_state": None}).generation == 6


def test_a_rank_killed_while_its_writer_process_writes_takes_the_writer_with_it_quietly(zygote, tmp_path):
    """The writer process of a rank that died leaves on its own, saying one line at most (it used
    to print BrokenPipeError and ConnectionResetError tracebacks)."""
    path, logs = str(tmp_path / "ckpt"), str(tmp_path / "writer-stderr")
    result = zygote.run("lifecycle_jobs:killed_while_the_writer_process_writes", 2, path, logs)
    _expect(result, [None, None], [signal.SIGKILL, signal.SIGKILL])
    writers = _writer_processes(result)
    for pid in writers:
        os.kill(pid, signal.SIGCONT)  # it finds its job, and its training process gone
    # A generous bound: the writer runs niced, at the lowest I/O priority, and beside busy loops it
    # gets a tenth of a core; what must fail is a writer that stays.
    stayed = [f"writer process {pid}: {kernel_state(pid)}" for pid in writers if not gone(pid, within_s=60)]
    assert not stayed, f"{stayed}\n{result.describe()}"
    for rank in range(2):
        with open(f"{logs}-{rank}") as f:
            said = f.read()
        assert len(said.splitlines()) <= 1 and "Traceback" not in said, said
    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 7))
    assert bcp.load(path, {"model": model, "extra_state": None}).generation == 2  # nothing else committed
