"""Loads next to their floors, in one run of interleaved rounds (medians): cold loads (page cache
evicted) next to a raw parallel read of the same bytes into preallocated memory and DCP; warm loads
next to a memcpy of the bytes; a resharded cold load on 2 processes; host memory over repeated loads.

    .venv/bin/python benchmarks/load_speed.py                 # 512 MB state, 5 rounds
    .venv/bin/python benchmarks/load_speed.py --size-mb 896 --reps 7 --json out.json

bcp loads with its defaults (``verify`` and ``transactional`` on) unless the method says otherwise.
"bcp, fresh staging" empties the staging pool before each load, as the first load of a process
finds it: it shows what touching fresh host memory costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bcp  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bcp.api.runtime import runtime  # noqa: E402

from bcpbench import disk, methods  # noqa: E402
from bcpbench.distributed import _cut, _expected, _local_destination, _mesh  # noqa: E402
from bcpbench.launch import launch  # noqa: E402
from bcpbench.memory import rss_bytes  # noqa: E402
from bcpbench.methods import Bcp, Dcp, RawFiles  # noqa: E402
from bcpbench.record import Record  # noqa: E402
from bcpbench.rounds import Entry, Group, Load, run_rounds, saving  # noqa: E402
from bcpbench.state import gpt_shapes, random_state, state_nbytes, zeros_in_one_block  # noqa: E402

COLD, WARM = "load cold, 1 process", "load warm, 1 process"
RESHARDED = "load cold, resharded Shard(0) -> Shard(1), 2 processes"
ROWS = "load cold, resharded Shard(1) -> Shard(0), 2 processes"
SAVE, SAVE_2P = "save, 1 process", "save, 2 processes"
RAW, MEMCPY = "raw read, 4 threads", "memcpy"
REPEATED_LOADS = 6


class FreshStaging(Bcp):
    """bcp's defaults, with the staging pool emptied before each load (a process's first load)."""

    def load(self, path: str, dest: dict) -> dict:
        runtime().load_staging.clear()
        return super().load(path, dest)


def single(config: dict[str, Any]) -> dict:
    record = Record()
    shapes = gpt_shapes(config["size_bytes"])
    state = random_state(shapes, seed=1)
    record.nbytes[COLD] = record.nbytes[WARM] = state_nbytes(state)
    flat, dest = zeros_in_one_block(shapes)
    io = config["io_threads"]

    def loads(loader: Any, method: str, warm: bool = True) -> list[Load]:
        cold = [Load(COLD, lambda p: loader.load(p, dest), expected=state, reset=flat.zero_, method=method)]
        return cold + ([Load(WARM, lambda p: loader.load(p, dest), cold=False, method=method)] if warm else [])

    raw = RawFiles(io)
    entries = [
        Entry(RAW, saving(raw, state), [Load(COLD, lambda p: raw.read(p, flat)),
                                        Load(WARM, lambda p: raw.read(p, flat), cold=False)]),
        Entry("bcp", saving(Bcp(io_threads=io), state),
              loads(Bcp(io_threads=io), "bcp")
              + loads(FreshStaging(io_threads=io), "bcp, fresh staging", warm=False)
              + loads(Bcp(io_threads=io, transactional=False), "bcp, transactional=False")
              + loads(Bcp(io_threads=io, verify=False), "bcp, verify=False", warm=False)),
        Entry("DCP", saving(Dcp(), state), loads(Dcp(), "DCP")),
        Entry(MEMCPY, None, [Load(WARM, lambda p: methods.copy_into(dest, state) or dest, cold=False)]),
    ]
    run_rounds(record, entries, SAVE, config["workdir"], config["reps"], Group())
    record.figures["rss after each repeated load"] = _repeated_loads(config, state, dest)
    return record.to_dict()


def _repeated_loads(config: dict, state: dict, dest: dict) -> list[int]:
    path = os.path.join(config["workdir"], "repeated")
    Bcp(io_threads=config["io_threads"]).save(path, state)
    loader = Bcp(io_threads=config["io_threads"])
    rss = []
    for _ in range(REPEATED_LOADS):
        loader.load(path, dest)
        rss.append(rss_bytes())
    disk.remove(path)
    return rss


def resharded(config: dict[str, Any]) -> dict:
    """Two layout changes. Shard(0) -> Shard(1): each process needs half of every saved row, and
    verification reads whole checksum chunks, so each reads all the saved bytes, twice its share
    (from a mapping of the files: the second process finds them in the page cache and nothing is
    copied but its share). Shard(1) -> Shard(0): each needs a contiguous half of every saved piece,
    its share (and the checksum chunk each half ends in), strided in its destination."""
    record = Record()
    rank, world, mesh = dist.get_rank(), dist.get_world_size(), _mesh()
    group = Group(rank, dist.barrier)
    shapes = gpt_shapes(config["size_bytes"])
    io = config["io_threads"]
    for case, saved_dim, loaded_dim in ((RESHARDED, 0, 1), (ROWS, 1, 0)):
        record.nbytes[case] = sum(t.numel() * 4 for t in (torch.empty(s, device="meta") for s in shapes.values()))
        source = _cut(shapes, saved_dim, rank, world, mesh)
        flat_saved, _ = _local_destination(shapes, saved_dim, world, mesh)
        flat, dest = _local_destination(shapes, loaded_dim, world, mesh)
        want = _expected(shapes, loaded_dim, rank, world)
        raw = RawFiles(io, f"rank{rank}")

        def load(loader: Any, case: str = case, dest: dict = dest, want: Any = want, flat: Any = flat) -> list[Load]:
            return [Load(case, lambda p: loader.load(p, dest), expected=want, reset=flat.zero_)]

        entries = [
            Entry(RAW, saving(raw, source), [Load(case, lambda p, raw=raw, f=flat_saved: raw.read(p, f))]),
            Entry("bcp", saving(Bcp(io_threads=io), source), load(Bcp(io_threads=io))),
            Entry("DCP", saving(Dcp(), source), load(Dcp())),
        ]
        run_rounds(record, entries, SAVE_2P, config["workdir"], config["reps"], group)
        del source, flat_saved, flat, dest
    return record.to_dict()


def table(record: Record) -> str:
    """Medians per case and method, with the ratios the targets name (higher is faster)."""
    lines = ["| case | method | median s | vs raw read or memcpy | vs DCP |", "|---|---|---|---|---|"]
    for case, by_method in record.samples.items():
        if case.startswith("save"):
            continue
        floor = record.median(case, MEMCPY if case == WARM else RAW)
        dcp = record.median(case, "DCP")
        for method in sorted(by_method, key=lambda m: record.median(case, m)):
            seconds = record.median(case, method)
            vs_floor = f"{floor / seconds:.2f}x" if floor and method not in (RAW, MEMCPY) else ""
            vs_dcp = f"{dcp / seconds:.2f}x" if dcp and method.startswith("bcp") else ""
            lines.append(f"| {case} | {method} | {seconds:.3f} | {vs_floor} | {vs_dcp} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--only", choices=("single", "resharded"))
    parser.add_argument("--json", help="write the raw samples here")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="bcp-load-speed-")
    config = {"size_bytes": int(args.size_mb * (1 << 20)), "reps": args.reps, "workdir": workdir,
              "io_threads": args.io_threads}
    load_before = os.getloadavg()
    record = Record()
    try:
        for name, fn, world in (("single", single, 1), ("resharded", resharded, 2)):
            if args.only in (None, name):
                record.merge(Record(launch(fn, world, config, timeout_s=1800)))
    finally:
        disk.remove(workdir)
    print(f"state {record.nbytes.get(COLD) or record.nbytes.get(RESHARDED)} bytes, {args.reps} rounds, "
          f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(table(record))
    rss = record.figures.get("rss after each repeated load")
    if rss:
        print(f"RSS after each of {len(rss)} repeated loads (MB): {[round(r / 1e6) for r in rss]} "
              f"(spread {(max(rss) - min(rss)) / 1e6:.1f} MB, median {statistics.median(rss) / 1e6:.0f} MB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record.to_dict(), f, indent=1)


if __name__ == "__main__":
    main()
