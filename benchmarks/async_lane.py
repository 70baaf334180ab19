"""The background lane beside training: a launch-bound training loop (about 1 ms of Python per step
on one thread, as a GPU trainer's host loop is) runs alone, then while an asynchronous save of the
state runs, for each candidate lane setting; a synchronous save of the same state is the anchor of
the save time. Interleaved rounds in one fresh process, medians.

    .venv/bin/python benchmarks/async_lane.py                  # 512 MB state, 3 rounds
    .venv/bin/python benchmarks/async_lane.py --size-mb 896 --rounds 5

The candidates: bcp's writer process (fed from shared memory), writing by direct I/O or through the
page cache, with 1, 2 or 4 files at once and at two priorities; bcp's writer threads at normal and
at background priority; DCP's async_save with its thread and with its process.

Targets: the step rate during the save >= 0.95x the rate alone, and the asynchronous save's call to
commit <= 1.5x the synchronous save. "Training time lost" is the save's time times the share of the
step rate it cost: what a lane takes from training in all, whatever its length.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import bcp  # noqa: E402
import bcp.engine.writer as writer_module  # noqa: E402
from bcp.engine import priority, writer_process  # noqa: E402

from bcpbench import disk  # noqa: E402
from bcpbench.launch import launch  # noqa: E402
from bcpbench.methods import DcpAsync  # noqa: E402
from bcpbench.state import gpt_shapes, random_state, state_nbytes  # noqa: E402

ALONE_S = 1.5
STEP_S = 0.001


def calibrated_step() -> Callable[[], None]:
    """A step of pure Python taking about ``STEP_S`` on this machine when alone."""
    def spin(n: int) -> int:
        total = 0
        for i in range(n):
            total += i
        return total

    def per_iteration(n: int = 20_000) -> float:
        started = time.perf_counter()
        spin(n)
        return (time.perf_counter() - started) / n

    # The fastest of several timings: the core's speed when nothing else ran on it, so that the
    # step is about STEP_S whatever the machine's other jobs did during the calibration.
    count = max(1, int(STEP_S / min(per_iteration() for _ in range(20))))
    return lambda: spin(count)


def steps_while(busy: Callable[[], bool], step: Callable[[], None]) -> tuple[float, list[float]]:
    """Steps until ``busy()`` is false: steps per second and each step's seconds."""
    times, started = [], time.perf_counter()
    while busy():
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return len(times) / (time.perf_counter() - started), times


@contextlib.contextmanager
def lane_settings(threads_lowered: bool, process_niceness: int, process_files: int,
                  direct: bool) -> Iterator[None]:
    """The lane's settings for one candidate: its writer threads' priority, its writer process's
    priority, how many files that process writes at once and whether it writes by direct I/O."""
    lower = writer_module.lower_this_thread
    before = priority.WRITER_PROCESS_NICENESS, writer_process.FILES_AT_ONCE, writer_process.DIRECT_IO
    if not threads_lowered:
        writer_module.lower_this_thread = lambda: None
    priority.WRITER_PROCESS_NICENESS, writer_process.FILES_AT_ONCE, writer_process.DIRECT_IO = \
        process_niceness, process_files, direct
    try:
        yield
    finally:
        writer_module.lower_this_thread = lower
        priority.WRITER_PROCESS_NICENESS, writer_process.FILES_AT_ONCE, writer_process.DIRECT_IO = before


@dataclasses.dataclass
class Candidate:
    """``start(path, state)`` starts an asynchronous save and returns something with ``done()``;
    ``prepare(path)``, untimed, before it (a writer process of this candidate's priority started)."""

    start: Callable[[str, dict], Any]
    prepare: Callable[[str], None] = lambda path: None


def candidates() -> dict[str, Candidate]:
    def bcp_async(writer: str, files: int, niceness: int, direct: bool = True) -> Candidate:
        def settings():
            return lane_settings(threads_lowered=niceness > 0, process_niceness=niceness, process_files=files,
                                 direct=direct)

        def prepare(path: str) -> None:
            if writer == "process":  # the lane starts a writer process of the requested priority
                with settings():
                    bcp.save(path, {"model": {"w": torch.zeros(4)}}, async_save=True, async_writer=writer).wait()
                disk.remove(path)

        def start(path: str, state: dict) -> Any:
            with settings():
                handle = bcp.save(path, {"model": state}, async_save=True, io_threads=files,
                                  async_writer=writer)
                if writer == "threads":  # they start in the background: keep the setting until they have
                    _wait_for_writers()
            return handle
        return Candidate(start, prepare)

    dcp = DcpAsync(reuse_stager=False)
    return {
        "no save: 1 s of waiting (the machine's own noise)": Candidate(lambda path, state: _Timer(1.0)),
        "bcp, writer process, direct I/O, 2 files, nice +10 (default)": bcp_async("process", 2, 10),
        "bcp, writer process, direct I/O, 2 files, nice +19": bcp_async("process", 2, 19),
        "bcp, writer process, direct I/O, 4 files, nice +19": bcp_async("process", 4, 19),
        "bcp, writer process, direct I/O, 1 file, nice +19": bcp_async("process", 1, 19),
        "bcp, writer process, direct I/O, 2 files, normal priority": bcp_async("process", 2, 0),
        "bcp, writer process, page cache, 2 files, nice +19 (the previous default)":
            bcp_async("process", 2, 19, direct=False),
        "bcp, writer process, page cache, 4 files, nice +10": bcp_async("process", 4, 10, direct=False),
        "bcp, threads, 4 files, nice +10": bcp_async("threads", 4, 10),
        "bcp, threads, 4 files, normal priority": bcp_async("threads", 4, 0),
        "DCP async_save (thread)": Candidate(lambda path, state: dcp.save_async(path, state)),
        "DCP async_save (process)": Candidate(lambda path, state: dcp.save_async(path, state, process=True)),
    }


class _Timer:
    """Done ``seconds`` after it starts: a save that does nothing, to show how much the step rate
    varies on this machine without one."""

    def __init__(self, seconds: float) -> None:
        self.until = time.perf_counter() + seconds

    def done(self) -> bool:
        return time.perf_counter() >= self.until

    def wait(self) -> None:
        pass


def _wait_for_writers(timeout: float = 2.0) -> None:
    import threading

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(t.name.startswith("bcp-write_") for t in threading.enumerate()):
        time.sleep(0.0005)


def run(config: dict[str, Any]) -> dict:
    if config.get("switch_interval"):  # diagnosis: how much of the cost is waiting for the GIL
        sys.setswitchinterval(config["switch_interval"])
    if not dist.is_initialized():  # DCP's process-based async_save needs a group, even of one
        dist.init_process_group("gloo")
    shapes = gpt_shapes(config["size_bytes"])
    state = random_state(shapes, seed=1)
    step = calibrated_step()
    results: dict[str, dict[str, list[float]]] = {}
    workdir = config["workdir"]

    def add(name: str, key: str, value: float) -> None:
        results.setdefault(name, {}).setdefault(key, []).append(value)

    starts = {name: c for name, c in candidates().items() if not config["only"] or config["only"] in name}
    for rnd in range(-1, config["rounds"]):  # round -1 warms up (buffers, plan cache), untimed
        until = time.perf_counter() + ALONE_S
        rate, times = steps_while(lambda: time.perf_counter() < until, step)
        if rnd >= 0:
            add("training alone", "steps/s", rate)
            add("training alone", "p99 step ms", 1e3 * statistics.quantiles(times, n=100)[98])
        path = os.path.join(workdir, f"sync-{rnd}")
        t = time.perf_counter()
        bcp.save(path, {"model": state}, io_threads=4)
        if rnd >= 0:
            add("synchronous save", "save s", time.perf_counter() - t)
        disk.remove(path)
        names = list(starts)
        for name in names[max(rnd, 0) % len(names):] + names[:max(rnd, 0) % len(names)]:
            path = os.path.join(workdir, f"{len(results)}-{rnd}")
            starts[name].prepare(path + "-prepare")
            t = time.perf_counter()
            handle = starts[name].start(path, state)
            rate, times = steps_while(lambda: not handle.done(), step)
            seconds = time.perf_counter() - t
            if hasattr(handle, "wait"):
                handle.wait()
            else:
                handle.result()
            if rnd >= 0:
                add(name, "steps/s", rate)
                add(name, "p99 step ms", 1e3 * statistics.quantiles(times, n=100)[98] if len(times) > 2 else 0)
                add(name, "save s", seconds)
            disk.remove(path)
    return {"results": results, "state_bytes": state_nbytes(state)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="only the candidates whose name contains this")
    parser.add_argument("--switch-interval", type=float,
                        help="the worker's sys.setswitchinterval (Python's default 0.005 s), to diagnose GIL waits")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="bcp-async-lane-")
    load_before = os.getloadavg()[0]
    try:
        out = launch(run, 1, {"size_bytes": int(args.size_mb * (1 << 20)), "rounds": args.rounds,
                              "workdir": workdir, "switch_interval": args.switch_interval,
                              "only": args.only}, timeout_s=1800)
    finally:
        disk.remove(workdir)
    results = out["results"]
    alone = statistics.median(results["training alone"]["steps/s"])
    sync = statistics.median(results["synchronous save"]["save s"])
    print(f"state {out['state_bytes'] / 1e6:.0f} MB, {args.rounds} rounds, switch interval "
          f"{args.switch_interval or sys.getswitchinterval()} s, load average before {load_before:.1f}, "
          f"after {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"training alone: {alone:.0f} steps/s, p99 step "
          f"{statistics.median(results['training alone']['p99 step ms']):.1f} ms; synchronous save {sync:.2f} s")
    print("| lane | steps/s during the save | vs alone | training time lost ms | p99 step ms | call to committed s "
          "| vs synchronous save |")
    print("|---|---|---|---|---|---|---|")
    for name, figures in results.items():
        if name in ("training alone", "synchronous save"):
            continue
        rate, seconds = statistics.median(figures["steps/s"]), statistics.median(figures["save s"])
        lost = 1e3 * seconds * (1 - rate / alone)  # the steps not taken during the save, in time
        print(f"| {name} | {rate:.0f} | {rate / alone:.3f}x | {lost:.0f} | "
              f"{statistics.median(figures['p99 step ms']):.1f} | {seconds:.2f} | {seconds / sync:.2f}x |")


if __name__ == "__main__":
    main()
