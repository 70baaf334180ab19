"""bcp on an accelerator, beside the hardware's floors and DCP, in one run: an FSDP2 model with AdamW
(by default 6 Linear layers of 8192 x 8192, 4.5 GiB of state with the optimizer's moments, the
shape of the first GPU measurement) saved and loaded by bcp and by DCP. The floors, measured on the
same bytes in the same run:

- device -> pinned host copy of the state: the least an asynchronous save can block for;
- pinned host -> device copy: the least a warm load's placing can cost;
- 4-thread fsync'd raw write of the state's bytes from host memory: a save's floor;
- cold 4-thread raw read of those bytes into pinned memory, then the copy to the device: a cold
  load's floor (the files dropped from the page cache first, as before every cold load here).

Every bcp load is checked bitwise against the values at its save's call, and one asynchronous save
is made right after a training step, while its kernels may still be queued, and checked against the
values that step produced while training goes on. The report prints the ratios and the targets;
``--json`` keeps every figure.

    python3 benchmarks/gpu.py                        # one GPU (scripts/gpu_check.sh runs this)
    torchrun --nproc-per-node=N benchmarks/gpu.py    # FSDP2 over N GPUs (NCCL; bcp coordinates over gloo)
    python benchmarks/gpu.py --device cpu --layers 2 --width 256   # the script's logic on the CPU

Times are the slowest rank's. On the CPU, "device" tensors are host tensors: the figures mean
nothing there, the checks still do.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bcp  # noqa: E402
from bcp.integration import runtime  # noqa: E402
from bcpbench import disk  # noqa: E402

TARGETS = {  # what the report checks, each against its floor (higher ratios are better)
    "sync save": 0.9,
    "load cold": 0.95,
    "load warm": 1 / 1.2,
}
FIRST_SAVE_LIMIT = 2.0  # the first async save's blocking, in steady saves' blocking
PINNING = "allocating pinned memory of the state's size"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (default where present) or cpu (the logic only)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions of each bcp case and floor")
    parser.add_argument("--io-threads", type=int, default=4, help="bcp io_threads and the raw floors' threads")
    parser.add_argument("--no-dcp", action="store_true", help="leave DCP out (to fit a tighter time budget)")
    parser.add_argument("--workdir", help="where checkpoints go (default: a new folder under benchmarks/results)")
    parser.add_argument("--json", help="every figure, as JSON (default: benchmarks/results/<date>-<time>-gpu.json)")
    return parser.parse_args()


@dataclass
class Run:
    """The process's place in the run and what it measured."""

    device: torch.device
    rank: int
    world: int
    workdir: str
    seconds: dict[str, list[float]] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def timed(self, case: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on every rank from a common start; note the slowest rank's seconds until its
        device work is done too."""
        synchronize(self.device)
        dist.barrier()
        started = time.perf_counter()
        out = fn()
        synchronize(self.device)
        self.seconds.setdefault(case, []).append(slowest(time.perf_counter() - started))
        return out

    def timed_async(self, case: str, fn: Callable[[], Any], finish: Callable[[Any], Any]) -> None:
        """As :meth:`timed` for an asynchronous save: ``case: blocking`` until ``fn`` returns, and
        ``case: call to committed`` until ``finish(what it returned)`` does."""
        synchronize(self.device)
        dist.barrier()
        started = time.perf_counter()
        pending = fn()
        returned = time.perf_counter()
        finish(pending)
        self.seconds.setdefault(f"{case}: blocking", []).append(slowest(returned - started))
        self.seconds.setdefault(f"{case}: call to committed", []).append(slowest(time.perf_counter() - started))

    def check(self, case: str, ok: bool) -> None:
        """Note whether ``case`` held on every rank."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(flag)
        self.checks[case] = self.checks.get(case, True) and int(flag) == 0

    def median(self, case: str) -> float:
        return statistics.median(self.seconds[case])


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def start(args: argparse.Namespace) -> Run:
    """The process group (one rank unless started by torchrun), this rank's device, the work folder."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cpu":
        device, backend = torch.device("cpu"), "gloo"
    else:
        device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
        torch.accelerator.set_device_index(device.index)
        backend = "cpu:gloo,cuda:nccl"  # DCP's async_save needs a CPU backend in the default group
    if world > 1:
        dist.init_process_group(backend, rank=rank, world_size=world)
    else:  # one process: an in-process store, no port another process could take first
        dist.init_process_group(backend, store=dist.HashStore(), rank=rank, world_size=world)
    workdir = [args.workdir or (tempfile.mkdtemp(prefix="gpu-", dir=_results()) if rank == 0 else None)]
    dist.broadcast_object_list(workdir)
    return Run(device, rank, world, workdir[0])


def build(args: argparse.Namespace, run: Run) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, each layer sharded with FSDP2 over every rank, after one AdamW step (so the
    optimizer has its moments)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(run.device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, optimizer, run.device)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    width = model[0].in_features
    model(torch.randn(8, width, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def local_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of this rank's share of the model and optimizer state, by name."""
    out = {f"model/{name}": _local(p) for name, p in model.state_dict().items()}
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"optimizer/{g}/{i}/{key}"] = _local(value)
    return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", copy=True) for name, t in local_tensors(model, optimizer).items()}


def same(model: nn.Module, optimizer: torch.optim.Optimizer, expected: dict[str, torch.Tensor]) -> bool:
    got = local_tensors(model, optimizer)
    return got.keys() == expected.keys() and all(torch.equal(got[k].detach().cpu(), expected[k]) for k in expected)


def perturb(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Change every value, so that a load has to bring each one back."""
    with torch.no_grad():
        for tensor in local_tensors(model, optimizer).values():
            tensor.add_(1)


def evict(run: Run, path: str) -> None:
    """Drop the files under ``path`` from the page cache (one machine: rank 0 does it for all)."""
    dist.barrier()
    if run.rank == 0:
        disk.evict(path)
    dist.barrier()


def floors(args: argparse.Namespace, run: Run, tensors: list[torch.Tensor]) -> None:
    """The hardware's floors for this rank's bytes, every rank at once."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pinned = run.device.type != "cpu"
    host = run.timed(PINNING, lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned))
    views, at = [], 0
    for tensor in tensors:
        views.append(host[at: at + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape))
        at += tensor.numel() * tensor.element_size()
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=run.device)
    raw = os.path.join(run.workdir, "raw", str(run.rank))
    for _ in range(args.reps):
        run.timed("device -> pinned copy", lambda: [v.copy_(t, non_blocking=True) for v, t in zip(views, tensors)])
        run.timed("pinned -> device copy", lambda: scratch.copy_(host, non_blocking=True))
        run.timed("raw write, fsync'd", lambda: disk.raw_write(raw, views, args.io_threads))
        evict(run, raw)
        files = disk.files_under(raw)
        run.timed("cold raw read + copy to device", lambda: (disk.raw_read(files, host, args.io_threads),
                                                               scratch.copy_(host, non_blocking=True)))
        disk.remove(raw)
    del host, views, scratch
    release = getattr(torch.accelerator, "empty_host_cache", None)
    if pinned and release is not None:  # the floors' pinned buffer, from torch's cache back to the system
        release()


def bcp_cases(args: argparse.Namespace, run: Run, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    path = os.path.join(run.workdir, "bcp")
    state = {"model": model, "optimizer": optimizer}
    options = {"io_threads": args.io_threads}
    saved = snapshot(model, optimizer)
    for case in ["bcp sync save, first of the structure"] + ["bcp sync save"] * args.reps:
        run.timed(case, lambda: bcp.save(path, state, **options))
    for case, transactional, cold, reps in (
            ("bcp load cold, first of the process", True, True, 1), ("bcp load cold", True, True, args.reps),
            ("bcp load cold, transactional=False", False, True, args.reps), ("bcp load warm", True, False, args.reps)):
        for _ in range(reps):
            perturb(model, optimizer)
            if cold:
                evict(run, path)
            run.timed(case, lambda: bcp.load(path, state, transactional=transactional, **options))
            run.check(f"{case}: bitwise", same(model, optimizer, saved))

    runtime().buffers.clear()  # no staging buffer and no pinned chunk yet, as the process's first save finds them
    runtime().chunks.clear()
    for case in ["bcp async save, first"] + ["bcp async save, steady"] * args.reps:
        run.timed_async(case, lambda: bcp.save(path, state, async_save=True, **options), lambda handle: handle.wait())
    steps_beside_first_save(run, model, optimizer, lambda: bcp.save(path, state, async_save=True, **options))
    train_step(model, optimizer, run.device)
    handle = bcp.save(path, state, async_save=True, **options)  # right after the step: its kernels may be queued
    at_call = snapshot(model, optimizer)
    train_step(model, optimizer, run.device)  # training goes on
    handle.wait()
    bcp.load(path, state, generation=handle.generation, **options)
    run.check("async save after a step, training going on: bitwise", same(model, optimizer, at_call))


def steps_beside_first_save(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer,
                            save: Callable[[], bcp.SaveHandle]) -> None:
    """Training steps while a process's first asynchronous save writes and its staging buffer is
    page-locked afterwards (on a thread of bcp's pool), against the same steps alone: as many as
    take about 8 s alone, the same number on every rank."""
    def steps(count: int) -> None:
        for _ in range(count):
            train_step(model, optimizer, run.device)
            synchronize(run.device)

    run.timed("10 training steps", lambda: steps(10))
    count = max(10, min(5000, int(80 / max(run.seconds["10 training steps"][-1], 1e-4))))
    run.timed("training steps alone", lambda: steps(count))
    runtime().buffers.clear()
    runtime().chunks.clear()
    handle = save()
    run.timed("training steps beside the first async save", lambda: steps(count))
    run.notes["page-locked within the steps"] = runtime().buffers.pinned_bytes > 0
    handle.wait()


def dcp_cases(args: argparse.Namespace, run: Run, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def save(path: str) -> None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)

    def save_async(path: str) -> Any:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return dcp.async_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)

    def load(path: str) -> None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)

    path = os.path.join(run.workdir, "dcp")
    saved = snapshot(model, optimizer)
    run.timed("DCP sync save", lambda: save(path))
    perturb(model, optimizer)
    evict(run, path)
    run.timed("DCP load cold", lambda: load(path))
    run.check("DCP load cold: bitwise", same(model, optimizer, saved))
    run.timed_async("DCP async save", lambda: save_async(path + "-async"), _finished)


def _finished(pending: Any) -> None:
    """Wait for a DCP asynchronous save (a future, or a response holding one, by torch version)."""
    future = getattr(pending, "upload_completion", pending)
    future.result()


def report(args: argparse.Namespace, run: Run, state_bytes: int) -> tuple[str, dict[str, Any]]:
    """The table of medians with their ratios, and the targets."""
    m = run.median
    gb = state_bytes * run.world / 1e9
    rows = [  # (case, floor or None, DCP case or None)
        ("bcp sync save", "raw write, fsync'd", "DCP sync save"),
        ("bcp sync save, first of the structure", "raw write, fsync'd", "DCP sync save"),
        ("bcp async save, first: blocking", "device -> pinned copy", "DCP async save: blocking"),
        ("bcp async save, steady: blocking", "device -> pinned copy", "DCP async save: blocking"),
        ("bcp async save, first: call to committed", None, "DCP async save: call to committed"),
        ("bcp async save, steady: call to committed", None, "DCP async save: call to committed"),
        ("bcp load cold", "cold raw read + copy to device", "DCP load cold"),
        ("bcp load cold, first of the process", "cold raw read + copy to device", "DCP load cold"),
        ("bcp load cold, transactional=False", "cold raw read + copy to device", "DCP load cold"),
        ("bcp load warm", "pinned -> device copy", None),
    ]
    lines = ["| case | bcp s | GB/s | floor | floor s | vs floor | DCP s | vs DCP |", "|---|---|---|---|---|---|---|---|"]
    for case, floor, dcp_case in rows:
        has_dcp = dcp_case is not None and dcp_case in run.seconds
        lines.append(f"| {case} | {m(case):.3f} | {gb / m(case):.2f} | {floor or ''} | "
                     f"{f'{m(floor):.3f}' if floor else ''} | {f'{m(floor) / m(case):.2f}x' if floor else ''} | "
                     f"{f'{m(dcp_case):.3f}' if has_dcp else ''} | {f'{m(dcp_case) / m(case):.2f}x' if has_dcp else ''} |")
    ratios = {"sync save": m("raw write, fsync'd") / m("bcp sync save"),
              "load cold": m("cold raw read + copy to device") / m("bcp load cold"),
              "load warm": m("pinned -> device copy") / m("bcp load warm")}
    first = m("bcp async save, first: blocking") / m("bcp async save, steady: blocking")
    targets = [f"sync save >= {TARGETS['sync save']}x the raw write: {ratios['sync save']:.2f}x "
               f"{_verdict(ratios['sync save'] >= TARGETS['sync save'])}",
               f"first async save's blocking <= {FIRST_SAVE_LIMIT:g}x the steady one: {first:.2f}x "
               f"{_verdict(first <= FIRST_SAVE_LIMIT)}",
               f"cold load >= {TARGETS['load cold']}x the read + copy floor: {ratios['load cold']:.2f}x "
               f"{_verdict(ratios['load cold'] >= TARGETS['load cold'])}",
               f"warm load within 1.2x a pinned copy to the device: {1 / ratios['load warm']:.2f}x it "
               f"{_verdict(ratios['load warm'] >= TARGETS['load warm'])}",
               f"every check held (bitwise loads): {_verdict(all(run.checks.values()))} "
               f"({', '.join(name for name, ok in run.checks.items() if not ok) or f'{len(run.checks)} checks'})"]
    beside = m("training steps alone") / m("training steps beside the first async save")
    locked = ("none on the CPU" if run.device.type == "cpu" else
              "done by the last step" if run.notes["page-locked within the steps"] else "not done by the last step")
    targets.append(f"training beside the first async save (its write, then its buffer's page-locking, {locked}): "
                   f"{beside:.2f}x the step rate alone")
    floors_line = (f"pinning {state_bytes / 2**30:.2f} GiB took {m(PINNING):.2f} s; "
                   f"device -> pinned {state_bytes / m('device -> pinned copy') / 1e9:.1f} GB/s, "
                   f"pinned -> device {state_bytes / m('pinned -> device copy') / 1e9:.1f} GB/s (per rank)")
    text = "\n".join([*lines, "", floors_line, "", "Targets:", *[f"- {t}" for t in targets]])
    return text, {"ratios": ratios, "first_to_steady": first, "steps_beside_first_save": beside, **run.notes}


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _machine(run: Run) -> str:
    if run.device.type == "cpu":
        return f"CPU only ({os.cpu_count()} cores): the figures mean nothing, the checks do"
    name = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else run.device.type
    return f"{run.world} x {name}, {os.cpu_count()} cores"


def _results() -> str:
    folder = os.path.join(HERE, "results")
    os.makedirs(folder, exist_ok=True)
    return folder


def main() -> int:
    args = parse()
    run = start(args)
    started = datetime.datetime.now()
    try:
        model, optimizer = build(args, run)
        tensors = list(local_tensors(model, optimizer).values())
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        if run.rank == 0:
            print(f"[gpu] {_machine(run)}; torch {torch.__version__}; {state_bytes * run.world / 2**30:.2f} GiB of "
                  f"state ({args.layers} x Linear({args.width}, {args.width}) + AdamW, FSDP2 over {run.world} "
                  f"rank(s)); {args.reps} repetitions", flush=True)
        floors(args, run, tensors)
        bcp_cases(args, run, model, optimizer)
        if not args.no_dcp:
            dcp_cases(args, run, model, optimizer)
        text, summary = report(args, run, state_bytes)
    finally:
        bcp.shutdown()
        dist.barrier()
        if run.rank == 0 and not args.workdir:
            shutil.rmtree(run.workdir, ignore_errors=True)
        dist.destroy_process_group()
    if run.rank == 0:
        print(text, flush=True)
        out = args.json or os.path.join(_results(), started.strftime("%Y-%m-%d-%H%M") + "-gpu.json")
        with open(out, "w") as f:
            json.dump({"machine": _machine(run), "torch": torch.__version__, "started": started.isoformat(" ", "minutes"),
                       "state_bytes_per_rank": state_bytes, "ranks": run.world, "layers": args.layers,
                       "width": args.width, "seconds": run.seconds, "checks": run.checks, **summary}, f, indent=1)
        print(f"[gpu] every figure: {out}", flush=True)
    return 0 if all(run.checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
