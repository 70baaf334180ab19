"""Put one full run's figures into ``docs/benchmarks.md``: the page's marked blocks (how it was
measured, the targets, saves, loads, async and FSDP1 saves, per-tensor overhead, planning) are
rendered again from the run's JSON; the hand-written sections between them stay as they are.
Nothing else writes that page: ``make bench`` and ``make bench-full`` write under
``benchmarks/results/`` only.

    .venv/bin/python benchmarks/publish.py                      # the newest benchmarks/results/*-full.json
    .venv/bin/python benchmarks/publish.py benchmarks/results/2026-11-26-0412-full.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from bcpbench.publish import PROFILE, PublishError, replace_blocks
from bcpbench.record import Record
from bcpbench.report import blocks

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
PAGE = os.path.join(HERE, "..", "docs", "benchmarks.md")


def newest_full_result() -> str:
    found = sorted(glob.glob(os.path.join(RESULTS, f"*-{PROFILE}.json")))
    if not found:
        raise PublishError(f"no {PROFILE} run in {os.path.normpath(RESULTS)}: run `make bench-full` first")
    return found[-1]


def publish(result: str, page: str) -> None:
    with open(result) as f:
        data = json.load(f)
    run = data["run"]
    if run.get("profile") != PROFILE:
        raise PublishError(f"{result} is a {run.get('profile')!r} run; the page holds {PROFILE} runs only")
    bodies = {name: body for name, (_, body) in blocks(Record(data), run).items()}
    with open(page) as f:
        text = f.read()
    text = replace_blocks(text, bodies)
    with open(page, "w") as f:
        f.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", nargs="?", help="a run's JSON (default: the newest full run's)")
    parser.add_argument("--page", default=PAGE, help="the page to update (default: docs/benchmarks.md)")
    args = parser.parse_args()
    try:
        result = args.result or newest_full_result()
        publish(result, args.page)
    except PublishError as error:
        sys.exit(f"[bench-docs] {error}")
    print(f"[bench-docs] {os.path.normpath(args.page)} now shows {os.path.normpath(result)}")


if __name__ == "__main__":
    main()
