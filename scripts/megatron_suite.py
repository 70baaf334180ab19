"""Megatron-Core's own checkpointing tests as a compatibility gate for bcp (not part of the product).

Runs Megatron-LM's ``tests/unit_tests/dist_checkpointing`` (or the files given) on the CPU, on
``--nproc`` gloo ranks under ``torchrun``, once per backend: with bcp as the default save strategy
and with torch_dist (the suite's own default), then compares. The CPU stand-ins live in
``scripts/megatron_suite_cpu.py``. A test counts as passed when it passed on every rank::

    BCP_MEGATRON_LM=/tmp/mlm-0.16 PYTHONPATH=/tmp/mlm-deps \\
        flock /tmp/bcp-ranks.lock .venv/bin/python scripts/megatron_suite.py test_serialization.py

The Megatron-LM tree is a checkout at the tag of the installed Megatron-Core (docs/megatron.md says
how to get one); its code is never committed here.
"""

from __future__ import annotations

import argparse
import collections
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


def run(tree: Path, backend: str, tests: list[str], nproc: int, timeout_s: int, results: Path) -> dict[str, str]:
    """Every test's outcome over all ranks: passed, failed, skipped, or not finished (timeout)."""
    (results / "tmp").mkdir(parents=True)  # the ranks' basetemps go below it
    sources = [str(ROOT / "packages" / p / "src") for p in ("bcp-core", "bcp-megatron")]
    env = {**os.environ, "BCP_SUITE_BACKEND": backend, "BCP_SUITE_RESULTS": str(results), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tree), str(HERE), *sources, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "pytest", "-p", "megatron_suite_cpu", "-p", "no:cacheprovider",
               "-o", "addopts=-rA", *tests]  # the tree's addopts has -x: one rank stopping hangs the others
    with open(results / "output.txt", "w") as output:
        # A session of its own: on timeout the whole job goes, torchrun's workers included.
        job = subprocess.Popen(command, cwd=tree, env=env, stdout=output, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            job.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            output.write(f"\ntimed out after {timeout_s} s\n")
    return merge([results / f"rank{r}.jsonl" for r in range(nproc)])


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="*", help=f"files or node ids under {SUITE} (default: all of it)")
    parser.add_argument("--megatron-lm", default=os.environ.get("BCP_MEGATRON_LM"), help="Megatron-LM tree")
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per backend")
    parser.add_argument("--out", type=Path, help="write the outcomes as JSON here")
    args = parser.parse_args()
    if not args.megatron_lm:
        parser.error("name a Megatron-LM tree with --megatron-lm or BCP_MEGATRON_LM")
    tree = Path(args.megatron_lm).resolve()
    tests = [f"{SUITE}/{t}" for t in args.tests] or [SUITE]
    work = Path(tempfile.mkdtemp(prefix="bcp-megatron-suite-"))
    try:
        outcomes = {b: run(tree, b, tests, args.nproc, args.timeout, work / b) for b in BACKENDS}
    finally:
        shutil.rmtree(work / "torch_dist" / "tmp", ignore_errors=True)
        shutil.rmtree(work / "bcp" / "tmp", ignore_errors=True)
    for backend in BACKENDS:
        counts = collections.Counter(outcomes[backend].values())
        print(f"{backend}: " + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())))
    regressions = [t for t, o in outcomes["torch_dist"].items() if o == "passed" and outcomes["bcp"].get(t) != "passed"]
    print(f"passed on torch_dist, not on bcp ({len(regressions)}):")
    for test in regressions:
        print(f"  {test}: {outcomes['bcp'].get(test, 'not run')}")
    print(f"per-rank output: {work}")
    if args.out:
        args.out.write_text(json.dumps(outcomes, indent=1))


if __name__ == "__main__":
    main()
