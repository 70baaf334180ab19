"""Where the time of a bcp save and cold load goes for one layout of the tensor path
(``bcpbench/tensor_path.py``), 1 process: bcp's per-phase seconds of timed calls, then one save
and one cold load under cProfile (the calling thread: writer and reader threads show as waits
there, their time is in the ``write`` and ``read`` phases).

    .venv/bin/python benchmarks/tensor_path_profile.py                   # {"t": dict}, 256 MB, 5 of each
    .venv/bin/python benchmarks/tensor_path_profile.py --layout module --size-mb 1024 --top 25

Uses bcp's public API only, so it measures any checkout's package: run it with that checkout's
``.venv/bin/python``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import os
import pstats
import statistics
import tempfile
import time
from typing import Any, Callable

import bcp

from bcpbench.disk import evict, remove
from bcpbench.state import random_state
from bcpbench.tensor_path import SEED, module_shapes, nbytes, tensors_of, trained, zeroed


def states(layout: str, size_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state saved and the live state loaded into, as ``layout`` holds the tensors."""
    model, optimizer = trained(random_state(module_shapes(size_bytes), SEED), SEED)
    if layout == "module":
        dest_model, dest_optimizer = trained(zeroed(tensors_of(model)), SEED)
        return {"model": model, "optimizer": optimizer}, {"model": dest_model, "optimizer": dest_optimizer}
    source = tensors_of(model, optimizer)
    if layout == "dict":
        return {"t": source}, {"t": zeroed(source)}
    return dict(source), zeroed(source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=("module", "dict", "top"), default="dict")
    parser.add_argument("--size-mb", type=float, default=256)
    parser.add_argument("--reps", type=int, default=5, help="timed saves and cold loads before the profiled ones")
    parser.add_argument("--top", type=int, default=15, help="functions listed per profile")
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--workdir", help="where the checkpoint is written (default: a new temporary folder)")
    args = parser.parse_args()
    source, dest = states(args.layout, int(args.size_mb * (1 << 20)))
    workdir = tempfile.mkdtemp(prefix="bcp-profile-", dir=args.workdir)
    paths = (os.path.join(workdir, f"ckpt-{i}") for i in itertools.count())
    saved: list[str] = []

    def save() -> bcp.PhaseStats:
        saved.append(next(paths))
        return bcp.save(saved[-1], source, io_threads=args.io_threads).stats

    def drop_older() -> None:
        """Each save gets a checkpoint of its own, as in the side-by-side rounds (no older
        generation for it to retire); the one before is removed, untimed."""
        while saved:
            remove(saved.pop())

    print(f"layout {args.layout}: {nbytes(_flat(source)) / 1e6:.0f} MB, bcp {bcp.__file__}")
    try:
        save()  # the first save plans; the timed ones reuse the cached plan, as training's do
        _measure("save", save, drop_older, args)
        _measure("cold load", lambda: bcp.load(saved[-1], dest, io_threads=args.io_threads).stats,
                 lambda: evict(workdir), args)
    finally:
        remove(workdir)


def _measure(what: str, call: Callable[[], bcp.PhaseStats], before: Callable[[], None],
             args: argparse.Namespace) -> None:
    """``args.reps`` timed calls (``before`` each, untimed), then one under cProfile."""
    seconds, phases = [], []
    for _ in range(args.reps):
        before()
        start = time.perf_counter()
        phases.append(call().seconds)
        seconds.append(time.perf_counter() - start)
    print(f"\n{what}: median {statistics.median(seconds):.3f} s [{min(seconds):.3f}, {max(seconds):.3f}]; "
          "phases (medians): " + ", ".join(f"{p} {statistics.median(s[p] for s in phases):.3f}" for p in phases[0]))
    before()
    print(_profiled(call, args.top))


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    if "model" in state:
        return tensors_of(state["model"], state["optimizer"])
    return state.get("t", state)


def _profiled(call: Callable[[], Any], top: int) -> str:
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.runcall(call)
    wall = time.perf_counter() - start
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return f"profiled call: {wall:.3f} s (with the profiler's overhead)\n" + _trimmed(out.getvalue())


def _trimmed(text: str) -> str:
    """pstats' table without its preamble."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return "\n".join(lines[start:])


if __name__ == "__main__":
    main()
