"""Side-by-side checkpointing benchmark: bcp next to DCP (default, tuned, async), torch.save,
safetensors and the disk's own floors, on one state, in one run; prints the targets at the end.

    .venv/bin/python benchmarks/run.py            # quick: 256 MB state, a few minutes (make bench)
    .venv/bin/python benchmarks/run.py --full     # ~2 GB state, the reference figures (make bench-full)
    .venv/bin/python benchmarks/run.py --size-mb 64 --reps 5 --only single
    .venv/bin/python benchmarks/run.py --full --only distributed --cases "2 -> 1 case"
    .venv/bin/python benchmarks/run.py --only tensors     # the tensor path alone (512 MB; 1 GB with --full)
    .venv/bin/python benchmarks/run.py --only every-step  # a save at every step of a training loop
    .venv/bin/python benchmarks/run.py --only cold-floor  # cold loads of plain dicts vs the raw read (896 MB)
    .venv/bin/python benchmarks/run.py --only compression # codecs, bcp, DCP on trained weights, disk and S3

Each group of cases runs in fresh processes (1 process; 2 gloo processes; 1 process for memory;
the tensor path's 1 and 2 gloo processes; 1 process for incremental saves of a 1 GB fine-tuning
state, whatever the profile; 1 process for a training loop with a save at every step, its size set
by the profile's ``every_step``; 1 process for compression on the states of a model it trains, its
size set by the profile's ``compression``, with a SeaweedFS server of its own), then
``planning_scale.py`` runs once. ``--size-mb`` sets the tensor path's size too. The report and the raw results go to
``benchmarks/results/<date>-<time>-<profile>.md`` and ``.json``, which git ignores; the tracked
``docs/benchmarks.md`` changes only through ``benchmarks/publish.py`` (``make bench-docs``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from importlib import metadata

from bcpbench import cold_floor, compression, distributed, every_step, incremental, memory, single, tensor_path
from bcpbench.disk import free_bytes, remove
from bcpbench.launch import launch
from bcpbench.record import Record
from bcpbench.report import render, summary
from bcpbench.state import gpt_shapes, shapes_nbytes

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILES = {
    # cold_floor_mb: each plain-dict state of the cold loads next to the raw read into the live tensors
    "quick": {"size_mb": 256, "reps": 5, "small_tensors": 1000, "tensor_path_mb": 512, "cold_floor_mb": 896,
              "timeout_s": 1800,
              # 192 MiB of parameters and AdamW moments, a step of ~170 ms on one core: about 40 s (a
              # smaller step is dominated by each save's fixed costs on a loaded 2-core machine)
              "every_step": {"width": 2048, "layers": 4, "batch": 128, "steps": 8, "rounds": 3, "saves": 60},
              # 9.5 M parameters: 19 MB of bf16 weights, 133 MB of mixed-precision state; ~25 s of training
              "compression": {"width": 1024, "layers": 8, "batch": 64, "steps": 200, "lr": 1e-3}},
    "full": {"size_mb": 2048, "reps": 5, "small_tensors": 2000, "tensor_path_mb": 1024, "cold_floor_mb": 2048,
             "timeout_s": 7200,
             # 384 MiB of parameters and AdamW moments, a step of 210-340 ms on one core: about 7 min
             "every_step": {"width": 2048, "layers": 8, "batch": 128, "steps": 12, "rounds": 3, "saves": 1000},
             # 38 M parameters: 76 MB of bf16 weights, 530 MB of mixed-precision state. A lower learning
             # rate: Adam moves every weight by about lr whatever the width, and at 1e-3 this width's loss
             # fell only from 0.25 to 0.21 in 200 steps (to 0.023 in 100 at 3e-4)
             "compression": {"width": 2048, "layers": 8, "batch": 64, "steps": 200, "lr": 3e-4}},
}
GROUPS = ("single", "distributed", "memory", "tensors", "cold-floor", "incremental", "every-step", "compression",
          "planning")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument("--quick", action="store_const", dest="profile", const="quick",
                         help="256 MB state (the default)")
    profile.add_argument("--full", action="store_const", dest="profile", const="full", help="2 GB state")
    parser.add_argument("--size-mb", type=float, help="state size, overriding the profile's")
    parser.add_argument("--reps", type=int, help="timed repetitions (at least 5 for the report)")
    parser.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS), help="groups of cases to run")
    parser.add_argument("--cases", nargs="+", metavar="LABEL",
                        help="of the 2-process group, only these groups of cases (e.g. '2 -> 1 case')")
    parser.add_argument("--io-threads", type=int, default=4, help="bcp io_threads and the raw floor's threads")
    parser.add_argument("--dcp-threads", type=int, default=4, help="thread_count of the tuned DCP writer")
    parser.add_argument("--saves", type=int, default=20, help="consecutive async saves of the memory case")
    parser.add_argument("--workdir", help="where checkpoints are written (default: a new temporary folder)")
    parser.add_argument("--out", help="the report (default: benchmarks/results/<date>-<time>-<profile>.md)")
    parser.add_argument("--json", help="raw results (default: the report's name, ending .json)")
    parser.add_argument("--note", action="append", default=[], help="a line to show at the top of the report")
    parser.set_defaults(profile="quick")
    return parser.parse_args()


def main() -> None:
    args = parse()
    settings = PROFILES[args.profile]
    size_bytes = int((args.size_mb or settings["size_mb"]) * (1 << 20))
    reps = args.reps or settings["reps"]
    workdir = tempfile.mkdtemp(prefix="bcp-bench-", dir=args.workdir)
    config = {"size_bytes": size_bytes, "reps": reps, "workdir": workdir, "io_threads": args.io_threads,
              "dcp_threads": args.dcp_threads, "small_tensors": settings["small_tensors"], "small_floats": 256,
              "fsdp1_bytes": size_bytes, "saves": args.saves, "cases": args.cases,
              "every_step": settings["every_step"], "compression": settings["compression"],
              "tensor_path_bytes": int((args.size_mb or settings["tensor_path_mb"]) * (1 << 20)),
              "cold_floor_bytes": int((args.size_mb or settings["cold_floor_mb"]) * (1 << 20))}
    _check_room(workdir, size_bytes)
    started, load_before, disk_before = time.time(), _load(), free_bytes(workdir)
    try:
        record = _run_groups(args.only, config, settings["timeout_s"])
    finally:
        remove(workdir)
    shapes = gpt_shapes(size_bytes)
    run = {
        "profile": args.profile, "command": " ".join(["benchmarks/run.py", *map(shlex.quote, sys.argv[1:])]),
        "commit": _commit(),
        "started": datetime.datetime.fromtimestamp(started).strftime("%Y-%m-%d %H:%M"), "reps": reps,
        "state_mb": shapes_nbytes(shapes) / 1e6, "tensors": len(shapes),
        "torch_threads_1p": record.figures.get("torch_threads_1p", "?"), "io_threads": args.io_threads,
        "dcp_threads": args.dcp_threads, "versions": _versions(),
        "machine": {"cores": os.cpu_count(), "ram_gb": _meminfo("MemTotal") / 1e9, "load_before": load_before,
                    "load_after": _load(), "disk_free_gb": disk_before / 1e9},
        "planning_scale": _planning_scale() if "planning" in args.only else None,
    }
    run["minutes"] = (time.time() - started) / 60
    stamp = time.strftime("%Y-%m-%d-%H%M", time.localtime(started))
    out = args.out or os.path.join(HERE, "results", f"{stamp}-{args.profile}.md")
    raw = args.json or os.path.splitext(out)[0] + ".json"
    _write(raw, {"run": run, **record.to_dict()})
    notes = list(args.note)
    if args.profile == "quick":
        notes.append(f"Quick run ({run['state_mb']:.0f} MB state): `make bench-full` measures the ~2 GB state "
                     "of the reference figures in docs/benchmarks.md.")
    if reps < 5:
        notes.append(f"Only {reps} repetition(s): too few to compare methods on this disk (5 or more).")
    with open(out, "w") as f:
        f.write(render(record, run, notes))
    print(f"\n{summary(record, run)}\n[bench] report: {os.path.normpath(out)}\n[bench] raw results: "
          f"{os.path.normpath(raw)}", flush=True)


def _run_groups(only: list[str], config: dict, timeout_s: float) -> Record:
    record = Record()
    for name, fn, world in (("single", single.run, 1), ("distributed", distributed.run, 2), ("memory", memory.run, 1),
                            ("tensors", tensor_path.one_process, 1), ("tensors", tensor_path.two_processes, 2),
                            ("cold-floor", cold_floor.run, 1),
                            ("incremental", incremental.run, 1), ("every-step", every_step.run, 1),
                            ("compression", compression.run, 1)):
        if name in only:
            print(f"[bench] {name}: {world} process(es), {config['reps']} reps", flush=True)
            t0 = time.time()
            record.merge(Record(launch(fn, world, config, timeout_s)))
            print(f"[bench] {name} done in {time.time() - t0:.0f} s", flush=True)
    return record


def _check_room(workdir: str, size_bytes: int) -> None:
    """Up to three generations of the memory case exist at once, plus one spare state; the
    incremental case holds about 4 GB at once (its four methods' files)."""
    need = max(4 * size_bytes + (1 << 30), 6 << 30)
    if free_bytes(workdir) < need:
        remove(workdir)
        raise SystemExit(f"{workdir}: {free_bytes(os.path.dirname(workdir)) / 1e9:.1f} GB free, "
                         f"{need / 1e9:.1f} GB needed (--workdir elsewhere or --size-mb smaller)")
    if _meminfo("MemAvailable") < 7 * size_bytes:
        print(f"[bench] warning: {_meminfo('MemAvailable') / 1e9:.1f} GB of memory available, about "
              f"{7 * size_bytes / 1e9:.1f} GB used at the peak (2 processes)", flush=True)


def _planning_scale() -> dict | None:
    print("[bench] planning_scale.py", flush=True)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        done = subprocess.run([sys.executable, os.path.join(HERE, "planning_scale.py"), "--json", out.name],
                              capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            print(f"[bench] planning_scale.py failed:\n{done.stderr[-2000:]}", flush=True)
            return None
        with open(out.name) as f:
            return json.load(f)


def _versions() -> str:
    import torch

    names = ("bcp-core", "safetensors", "numpy")
    return ", ".join([f"torch {torch.__version__}", *(f"{n} {metadata.version(n)}" for n in names),
                      f"Python {sys.version.split()[0]}"])


def _commit() -> str:
    """The code measured: the commit of the bcp package imported, marked ``+changes`` when its work
    tree differs from it; and the benchmarks' own where they come from another checkout (a package
    of another commit measured by this harness)."""
    import bcp

    def git(where: str, *args: str) -> str:
        done = subprocess.run(["git", "-C", where, *args], capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    def described(where: str) -> str:
        commit = git(where, "rev-parse", "--short", "HEAD")
        if not commit:
            return "unknown (not a git checkout)"
        return commit + (" +changes" if git(where, "status", "--porcelain", "--untracked-files=no") else "")

    package = os.path.dirname(bcp.__file__)
    if git(package, "rev-parse", "--show-toplevel") == git(HERE, "rev-parse", "--show-toplevel"):
        return described(package)
    return f"{described(package)} (bcp-core), benchmarks/ at {described(HERE)}"


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
