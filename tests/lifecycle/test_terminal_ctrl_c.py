"""Ctrl-C from a terminal during an asynchronous save does what bcp's message says: the terminal's
SIGINT reaches the job's whole process group (bcp's writer processes included), yet the first one
lets the pending save commit, a second abandons it, and an abandoned save leaves nothing behind.

Guards a defect where the writer process took the terminal's SIGINT and died with a traceback, so
the save failed at once, and its generation's folder (holding its claim) stayed on disk."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import bcp
from bcp.engine.location import METRICS_DIR
from process_checks import gone, own_process_group

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "terminal_job.py")
STEP_TIMEOUT_S = 120.0


class TerminalJob:
    """``terminal_job.py`` leading a process group of its own, its output read as it comes."""

    def __init__(self, path: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        self.proc = subprocess.Popen([sys.executable, JOB, path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, **own_process_group())
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append("")  # the end of the output
            self._changed.notify_all()

    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for(self, pattern: str, count: int) -> list[re.Match]:
        """The first ``count`` lines matching ``pattern``; an AssertionError naming it if they do
        not come within ``STEP_TIMEOUT_S`` (the job is then killed)."""
        def found() -> list[re.Match]:
            return [m for line in self.lines if (m := re.search(pattern, line))]

        with self._changed:
            if self._changed.wait_for(lambda: len(found()) >= count or "" in self.lines, STEP_TIMEOUT_S) \
                    and len(found()) >= count:
                return found()[:count]
        self.kill()
        raise AssertionError(f"{count} line(s) matching {pattern!r} did not come within {STEP_TIMEOUT_S:g}s:\n"
                             f"{self.output()}")

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def finish(self) -> str:
        """The whole output once the launcher has reported both ranks' ends."""
        self.wait_for(r"rank 1 ended: ", 1)
        self.proc.wait(STEP_TIMEOUT_S)
        return self.output()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def job(tmp_path):
    """The job, with its writer processes stopped and generation 3 pending on each rank."""
    started = TerminalJob(str(tmp_path / "ckpt"))
    yield started
    started.kill()


def _stopped_writers(job: TerminalJob) -> list[int]:
    return [int(m.group(1)) for m in job.wait_for(r"rank \d: writer process (\d+) stopped; training", 2)]


def _go_on(writers: list[int]) -> None:
    for pid in writers:
        os.kill(pid, signal.SIGCONT)


def _latest(path: str) -> tuple[int, float]:
    """The newest committed generation and the value its parameters hold."""
    from terminal_job import model

    loaded = model(0.0)
    generation = bcp.load(path, {"model": loaded}).generation
    values = {p.unique().item() for p in loaded.parameters()}
    assert len(values) == 1, values
    return generation, values.pop()


def test_a_ctrl_c_to_the_process_group_lets_the_pending_save_commit(job, tmp_path):
    writers = _stopped_writers(job)
    job.ctrl_c()  # reaches the writer processes too, which are stopped: it waits for them
    job.wait_for(r"bcp: waiting for 1 asynchronous save\(s\) to commit", 2)
    _go_on(writers)
    out = job.finish()
    assert re.search(r"rank 0 ended: signal SIGINT\n(.|\n)*rank 1 ended: signal SIGINT", out), out
    assert out.count("Traceback (most recent call last)") == 2, out  # each rank's KeyboardInterrupt, no other
    assert _latest(str(tmp_path / "ckpt")) == (3, 3.0)
    assert all(gone(pid) for pid in writers)


def test_a_second_ctrl_c_to_the_process_group_abandons_the_save_and_leaves_nothing(job, tmp_path):
    writers = _stopped_writers(job)
    job.ctrl_c()
    job.wait_for(r"bcp: waiting for 1 asynchronous save\(s\) to commit", 2)
    job.ctrl_c()  # the second: abandon
    job.wait_for(r"bcp: abandoning 1 asynchronous save\(s\): their writes stop now", 2)
    _go_on(writers)  # each finds the request to abandon with its job
    out = job.finish()
    assert re.search(r"rank 0 ended: signal SIGINT\n(.|\n)*rank 1 ended: signal SIGINT", out), out
    assert len(re.findall(r"bcp: abandoned 1 asynchronous save\(s\): .*their uncommitted files were removed", out)) \
        == 2, out
    path = str(tmp_path / "ckpt")
    assert sorted(os.listdir(path)) == [METRICS_DIR, "gen-00000001", "gen-00000002"], out  # nothing of generation 3
    assert _latest(path) == (2, 2.0)
    assert out.count("Traceback (most recent call last)") == 2, out
    assert all(gone(pid) for pid in writers)


def _truthful(out: str, path: str) -> None:
    """What each rank said became of generation 3 is what the disk holds; no traceback but each
    rank's KeyboardInterrupt."""
    committed = re.findall(r"bcp: .*committed 1 asynchronous save\(s\)", out)
    abandoned = re.findall(r"bcp: .*abandoned 1 asynchronous save\(s\): .*their uncommitted files were removed", out)
    assert len(committed) + len(abandoned) <= 2 and not (committed and abandoned), out
    if committed:
        assert _latest(path) == (3, 3.0), out
    else:
        assert "gen-00000003" not in os.listdir(path) and _latest(path) == (2, 2.0), out
    assert out.count("Traceback (most recent call last)") == 2, out


def test_a_second_ctrl_c_right_after_the_commit_says_the_save_committed(job, tmp_path):
    path = str(tmp_path / "ckpt")
    writers = _stopped_writers(job)
    job.ctrl_c()
    job.wait_for(r"bcp: waiting for 1 asynchronous save\(s\) to commit", 2)
    _go_on(writers)
    marker = os.path.join(path, "gen-00000003", "COMMITTED")
    while not os.path.exists(marker) and job.proc.poll() is None:
        time.sleep(0.001)
    job.ctrl_c()  # the second, once generation 3 is committed
    out = job.finish()
    assert "abandoned" not in out, out
    _truthful(out, path)


def test_two_ctrl_cs_50_ms_apart_exit_without_a_traceback_from_bcp(job, tmp_path):
    writers = _stopped_writers(job)
    job.ctrl_c()
    time.sleep(0.05)
    job.ctrl_c()
    _go_on(writers)
    _truthful(job.finish(), str(tmp_path / "ckpt"))
