"""Megatron-Core's own checkpointing tests as a compatibility gate for bcp (not part of the product).

Runs Megatron-LM's ``tests/unit_tests/dist_checkpointing`` (or the files and node ids given) on the
CPU, on ``--nproc`` gloo ranks under ``torchrun``, one argument at a time, once per backend: with
bcp as the default save strategy and with torch_dist (the suite's own default), then compares. The
CPU stand-ins live in ``scripts/megatron_suite_cpu.py``. A test counts as passed when it passed on
every rank. With ``--lock``, each argument's two runs hold that file lock (the machine's shared
lock for multi-process work), so other work gets the cores between files::

    BCP_MEGATRON_LM=/tmp/mlm PYTHONPATH=/tmp/mlm-deps .venv/bin/python scripts/megatron_suite.py \
        --lock /tmp/bcp-ranks.lock --timeout 600 test_serialization.py test_async_save.py

The Megatron-LM tree is a checkout at the tag of the installed Megatron-Core (docs/megatron.md says
how to get one); its code is never committed here.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SUITE = "tests/unit_tests/dist_checkpointing"
BACKENDS = ("torch_dist", "bcp")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run(tree: Path, backend: str, tests: list[str], nproc: int, timeout_s: int, results: Path,
        keyword: str | None = None, deselect: tuple[str, ...] = ()) -> dict[str, str]:
    """Every test's outcome over all ranks: passed, failed, skipped, or not finished (timeout)."""
    (results / "tmp").mkdir(parents=True)  # the ranks' basetemps go below it
    sources = [str(ROOT / "packages" / p / "src") for p in ("bcp-core", "bcp-megatron")]
    env = {**os.environ, "BCP_SUITE_BACKEND": backend, "BCP_SUITE_RESULTS": str(results), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tree), str(HERE), str(ROOT / "tests" / "megatron"), *sources,
                                          os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "pytest", "-p", "megatron_suite_cpu", "-p", "no:cacheprovider",
               # not the tree's addopts, whose -x would leave the other ranks waiting on a stopped one
               "-o", "addopts=-rA", *(["-k", keyword] if keyword else []),
               *[f"--deselect={SUITE}/{test}" for test in deselect], *tests]
    with open(results / "output.txt", "w") as output:
        # A session of its own, so that a timeout ends torchrun; its workers are ended by pid.
        job = subprocess.Popen(command, cwd=tree, env=env, stdout=output, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            job.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            output.write(f"\ntimed out after {timeout_s} s\n")
        finally:  # timed out, or this driver was stopped
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
                end_workers(results, nproc)
    return merge([results / f"rank{r}.jsonl" for r in range(nproc)])


def end_workers(results: Path, nproc: int) -> None:
    """Kill the ranks that outlived torchrun (it starts them in sessions of their own), by the pids
    they wrote."""
    for rank in range(nproc):
        pid_file = results / f"rank{rank}.pid"
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def merge(files: list[Path]) -> dict[str, str]:
    per_rank: list[dict[str, str]] = []
    for file in files:
        outcomes: dict[str, str] = {}
        for line in file.read_text().splitlines() if file.exists() else []:
            phase = json.loads(line)
            before = outcomes.get(phase["test"])
            if phase["outcome"] == "failed" or before == "failed":
                outcomes[phase["test"]] = "failed"
            elif phase["outcome"] == "skipped":
                outcomes[phase["test"]] = "skipped"
            elif phase["when"] == "call":
                outcomes[phase["test"]] = "passed"
        per_rank.append(outcomes)
    merged = {}
    for test in sorted(set().union(*per_rank)):
        seen = {outcomes.get(test, "not finished") for outcomes in per_rank}
        merged[test] = seen.pop() if len(seen) == 1 else ("failed" if "failed" in seen else "not finished")
    return merged


def suite_files(tree: Path) -> list[str]:
    """Every test file of the suite, relative to it."""
    return sorted(str(p.relative_to(tree / SUITE)) for p in (tree / SUITE).rglob("test_*.py"))


@contextlib.contextmanager
def held(lock: Path | None):
    """The file lock ``lock`` held (nothing without one)."""
    if lock is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def counts(outcomes: dict[str, str]) -> str:
    tally = collections.Counter(outcomes.values())
    return ", ".join(f"{n} {kind}" for kind, n in sorted(tally.items())) or "nothing ran"


def report(outcomes: dict[str, dict[str, str]], groups: dict[str, list[str]]) -> None:
    """Per argument and in all: each backend's counts, then what passed on torch_dist and not on bcp."""
    print("| tests | torch_dist | bcp |\n| --- | --- | --- |")
    for group, tests in groups.items():
        print(f"| {group} | " + " | ".join(counts({t: outcomes[b][t] for t in tests if t in outcomes[b]})
                                          for b in BACKENDS) + " |")
    print("| **all** | " + " | ".join(counts(outcomes[b]) for b in BACKENDS) + " |")
    regressions = [t for t, o in outcomes["torch_dist"].items() if o == "passed" and outcomes["bcp"].get(t) != "passed"]
    print(f"passed on torch_dist, not on bcp ({len(regressions)}):")
    for test in regressions:
        print(f"  {test}: {outcomes['bcp'].get(test, 'not run')}")
    both = [t for t, o in outcomes["torch_dist"].items() if o != "passed" and outcomes["bcp"].get(t) == o]
    print(f"the same outcome other than passed on both ({len(both)}):")
    for test in both:
        print(f"  {test}: {outcomes['bcp'][test]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="*", help=f"files or node ids under {SUITE}, run one at a time "
                                                 "(default: each test file of it)")
    parser.add_argument("--megatron-lm", default=os.environ.get("BCP_MEGATRON_LM"), help="Megatron-LM tree")
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per argument and backend")
    parser.add_argument("-k", dest="keyword", help="pytest's -k expression, for every argument")
    parser.add_argument("--deselect", action="append", default=[],
                        help="a node id under the suite not to run (repeatable): one that leaves the ranks out of step")
    parser.add_argument("--lock", type=Path, help="file lock held while an argument's runs go on")
    parser.add_argument("--out", type=Path, help="write the outcomes as JSON here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: end the job it runs (finally)
    if not args.megatron_lm:
        parser.error("name a Megatron-LM tree with --megatron-lm or BCP_MEGATRON_LM")
    tree = Path(args.megatron_lm).resolve()
    work = Path(tempfile.mkdtemp(prefix="bcp-megatron-suite-"))
    outcomes: dict[str, dict[str, str]] = {b: {} for b in BACKENDS}
    groups: dict[str, list[str]] = {}
    for index, test in enumerate(args.tests or suite_files(tree)):
        with held(args.lock):
            for backend in BACKENDS:
                results = work / f"{index:03d}" / backend
                try:
                    found = run(tree, backend, [f"{SUITE}/{test}"], args.nproc, args.timeout, results, args.keyword,
                                tuple(args.deselect))
                finally:
                    shutil.rmtree(results / "tmp", ignore_errors=True)
                outcomes[backend].update(found)
                groups.setdefault(test, []).extend(t for t in found if t not in groups[test])
        print(f"{test}: " + "; ".join(f"{b} {counts({t: outcomes[b][t] for t in groups[test] if t in outcomes[b]})}"
                                      for b in BACKENDS), flush=True)
        if args.out:  # after each argument, so that an interrupted run keeps what finished
            args.out.write_text(json.dumps(outcomes, indent=1))
    report(outcomes, groups)
    print(f"per-rank output: {work}")


if __name__ == "__main__":
    main()
