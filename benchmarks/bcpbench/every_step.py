"""A checkpoint at every step, in a fresh process: a training loop (an MLP and AdamW, one training
thread) without checkpoints, with a memory-tier async save after every step, with the same saves
overlapped (``overlap=True``: the copy runs while the next forward and backward do), and with DCP's
``async_save`` after every step (to a local folder, each waiting for the previous one as a user
would). Interleaved rounds, medians. Then a long run of overlapped saves: resident memory and the
tier's files in ``/dev/shm`` after save 10 and after the last, so that a growth shows."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import bcp
import torch
from torch import nn

from bcpbench import disk
from bcpbench.memory import rss_bytes
from bcpbench.record import Record, rotated

NONE, ASYNC, OVERLAP, DCP = "no checkpoint", "bcp async_save", "bcp async_save, overlap=True", "DCP async_save"
STEP = "every step: step time, 1 process"
BLOCKING = "every step: blocking per save, 1 process"
MODEL, GROWTH, BARE_COPY = "every-step model", "every-step memory", "every-step bare copy seconds"
SHM = "/dev/shm"


def build(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters and AdamW's moments (its step counts are scalars)."""
    return list(model.parameters()) + [t for s in optimizer.state.values() for t in s.values()
                                       if isinstance(t, torch.Tensor) and t.dim()]


def bare_copy_s(model: nn.Module, optimizer: torch.optim.Optimizer, reps: int = 5) -> float:
    """The copy of parameters and optimizer state into buffers allocated once, median seconds."""
    sources = state_tensors(model, optimizer)
    buffers = [torch.empty_like(t) for t in sources]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for dest, source in zip(buffers, sources):
            dest.copy_(source)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Savers:
    """One save after a step, per method: bcp to a memory tier (async, or async and overlapped), or
    DCP's async_save, which waits for its previous save first (one in flight, as a user would)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, root: str, tier_dir: str) -> None:
        self.model, self.optimizer, self.root = model, optimizer, root
        self.tier = bcp.MemoryTier(local_dir=tier_dir, replicas=0)  # one process: no peer
        self.pending_dcp: Any = None
        self.dcp_saves = 0

    def save(self, method: str) -> None:
        if method == DCP:
            import torch.distributed.checkpoint as dcp

            self.wait_dcp()
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            # Two folders in turn: a save never overwrites the one a crash would fall back to.
            self.dcp_saves += 1
            self.pending_dcp = dcp.async_save(state, checkpoint_id=os.path.join(self.root, f"dcp-{self.dcp_saves % 2}"))
        elif method != NONE:
            bcp.save(self.tier, {"model": self.model, "optimizer": self.optimizer}, async_save=True,
                     overlap=method == OVERLAP)

    def wait_dcp(self) -> None:
        if self.pending_dcp is not None:
            self.pending_dcp.result()
            self.pending_dcp = None

    def drain(self) -> None:
        self.wait_dcp()
        bcp.wait_pending_saves()


def run(config: dict[str, Any]) -> dict:
    settings = config["every_step"]
    torch.set_num_threads(1)  # one training thread: the copy and the writes take another core
    record = Record()
    model, optimizer = build(settings["width"], settings["layers"])
    x = torch.randn(settings["batch"], settings["width"])
    step(model, optimizer, x)  # AdamW's state exists from here on
    state_bytes = sum(t.numel() * t.element_size() for t in state_tensors(model, optimizer))
    rss_without_saves = rss_bytes()
    root = os.path.join(config["workdir"], "every-step")
    with tempfile.TemporaryDirectory(prefix="bcp-bench-every-step-", dir=SHM if os.path.isdir(SHM) else None) as shm:
        savers = Savers(model, optimizer, root, os.path.join(shm, "tier"))
        methods = [NONE, ASYNC, OVERLAP, DCP]
        ratios: dict[str, list[float]] = {m: [] for m in methods[1:]}
        for round_ in range(settings["rounds"]):
            medians = {}
            for method in rotated(methods, round_):
                steps, blocked = _steps(savers, method, model, optimizer, x, settings["steps"])
                for seconds in steps:
                    record.add(STEP, method, seconds)
                for seconds in blocked:
                    record.add(BLOCKING, method, seconds)
                medians[method] = statistics.median(steps)
            for method in methods[1:]:  # per round: the machine's load changes between rounds
                ratios[method].append(medians[method] / medians[NONE])
        record.figures[GROWTH] = _growth(savers, model, optimizer, x, settings["saves"], os.path.join(shm, "tier"))
        bcp.shutdown()
    record.figures[MODEL] = {**settings, "state_bytes": state_bytes, "rss_without_saves": rss_without_saves,
                             "ratios": {m: statistics.median(r) for m, r in ratios.items()}}
    record.figures[BARE_COPY] = bare_copy_s(model, optimizer)
    disk.remove(root)
    return record.to_dict()


def _steps(savers: Savers, method: str, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
           count: int) -> tuple[list[float], list[float]]:
    """Step times (a step and its save) and the seconds each save blocked, the first step not counted
    (it waits for the previous method's last save)."""
    steps, blocked = [], []
    for _ in range(count + 1):
        start = time.perf_counter()
        step(model, optimizer, x)
        called = time.perf_counter()
        savers.save(method)
        blocked.append(time.perf_counter() - called)
        steps.append(time.perf_counter() - start)
    savers.drain()
    return steps[1:], blocked[1:] if method != NONE else []


def _growth(savers: Savers, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, saves: int,
            tier_dir: str) -> dict[str, Any]:
    """Resident memory, the tier's files and ``/dev/shm``'s use after save 10 and after save ``saves``
    of an every-step overlapped run (each measured once that save committed)."""
    out: dict[str, Any] = {"saves": saves, "rss_before": rss_bytes()}
    for done in range(1, saves + 1):
        step(model, optimizer, x)
        savers.save(OVERLAP)
        if done in (10, saves):
            bcp.wait_pending_saves()
            out[f"after_{'10' if done == 10 else 'last'}"] = {
                "rss": rss_bytes(), "tier_files": _folder_bytes(tier_dir), "shm_used": _used_bytes(SHM)}
    bcp.wait_pending_saves()
    return out


def _folder_bytes(path: str) -> int:
    """Bytes the folder's files occupy (allocated blocks: what they hold of memory on tmpfs), each
    file once however many names it has (a tier's data file is also a staging file)."""
    stats = (os.stat(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    return sum({stat.st_ino: stat.st_blocks * 512 for stat in stats}.values())


def _used_bytes(path: str) -> int:
    """The file system's used bytes: on ``/dev/shm`` also shared memory whose files are unlinked
    (other processes' too)."""
    if not os.path.isdir(path):
        return 0
    fs = os.statvfs(path)
    return (fs.f_blocks - fs.f_bfree) * fs.f_frsize


def step_ratio(record: Record, method: str) -> float | None:
    """The median over rounds of each round's ratio of ``method``'s median step time to no checkpoint's."""
    return record.figures.get(MODEL, {}).get("ratios", {}).get(method)


def report_lines(record: Record) -> list[str]:
    """The table of step times and blocking per method, and the memory after 10 saves and after the last."""
    model, growth = record.figures.get(MODEL), record.figures.get(GROWTH)
    if not model or STEP not in record.samples:
        return []
    alone = record.median(STEP, NONE)
    copy = record.figures.get(BARE_COPY)
    bare = (f" The bare copy of the state into reused buffers takes {copy * 1e3:.1f} ms, {copy / alone:.1%} of the "
            "step without checkpoints." if copy and alone else "")
    lines = [(f"An MLP of {model['layers']} layers {model['width']} wide and AdamW ({model['state_bytes'] / 2**20:.0f} "
              f"MiB of parameters and moments; batch {model['batch']}), one process, one training thread "
              f"(`torch.set_num_threads(1)`): the background copy and writes need another core. A save after every "
              f"step; {model['rounds']} interleaved rounds of {model['steps']} steps per method.{bare} bcp saves to "
              "a `MemoryTier` in /dev/shm (`replicas=0`); DCP's `async_save` writes to a local folder and waits for its previous "
              "save first. `vs no checkpoint` = the median over rounds of each round's ratio of median step times."),
             "", "| method | step ms | vs no checkpoint | blocking per save ms | spread of steps ms |",
             "| --- | --- | --- | --- | --- |"]
    for method, values in record.samples[STEP].items():
        ratio_ = model["ratios"].get(method, 1.0)
        blocking = record.median(BLOCKING, method)
        lines.append(f"| {method} | {statistics.median(values) * 1e3:.1f} | {ratio_:.3f}x | "
                     f"{'-' if blocking is None else f'{blocking * 1e3:.1f}'} | "
                     f"[{min(values) * 1e3:.1f}, {max(values) * 1e3:.1f}] |")
    if growth:
        first, last, mb = growth["after_10"], growth["after_last"], 2**20
        lines += ["", (f"Memory over {growth['saves']} consecutive overlapped saves, one per step (each figure once "
                       f"that save committed; RSS of the loop before any save: {model['rss_without_saves'] / mb:.0f} "
                       f"MiB, before the first of these: {growth['rss_before'] / mb:.0f} MiB; "
                       "`/dev/shm used` counts every process's shared memory on the machine):"), "",
                  f"| MiB | after save 10 | after save {growth['saves']} | growth |", "| --- | --- | --- | --- |"]
        for key, label in (("rss", "resident memory (RSS)"), ("tier_files", "the tier's files"),
                           ("shm_used", "/dev/shm used")):
            lines.append(f"| {label} | {first[key] / mb:.0f} | {last[key] / mb:.0f} | "
                         f"{(last[key] - first[key]) / mb:+.0f} |")
    return lines + [""]
