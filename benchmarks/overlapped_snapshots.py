"""Snapshots at every step: a training loop (an MLP and AdamW, one process, one training thread)
without checkpoints, with an asynchronous memory-tier save after every step, and with the same
saves overlapped (``overlap=True``: the copy of the parameters and optimizer state runs while the
next forward and backward do). Interleaved rounds in one process, medians.

    .venv/bin/python benchmarks/overlapped_snapshots.py                 # 4 x 2048 wide, 3 rounds
    .venv/bin/python benchmarks/overlapped_snapshots.py --width 1024 --rounds 2 --steps 8

Reported: the bare copy of the state (parameters and AdamW's two moments into reused host buffers)
as a share of the step, each mode's step time as a multiple of the loop without checkpoints (the
median over rounds of each round's ratio of medians), and the time each save blocks the training
thread (the call to ``bcp.save``). The background copy and the writes need a free core beside the
training thread: on a loaded machine the step-time ratios say so, the blocking times much less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

import bcp
from bcpbench.every_step import bare_copy_s, build, step

MODES = ("none", "async", "overlap")


def run_mode(mode: str, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, steps: int,
             tier: bcp.MemoryTier) -> tuple[list[float], list[float]]:
    """Step times and (saving modes) the seconds each save blocked, for ``steps`` steps."""
    state = {"model": model, "optimizer": optimizer}
    step_s, blocked_s = [], []
    for _ in range(steps):
        start = time.perf_counter()
        step(model, optimizer, x)
        if mode != "none":
            called = time.perf_counter()
            bcp.save(tier, state, async_save=True, overlap=mode == "overlap")
            blocked_s.append(time.perf_counter() - called)
        step_s.append(time.perf_counter() - start)
    bcp.wait_pending_saves()
    return step_s, blocked_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12, help="steps per mode and round (the first is not counted)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one training thread: the copy and the writes take another core
    model, optimizer = build(args.width, args.layers)
    x = torch.randn(args.batch, args.width)
    step(model, optimizer, x)  # AdamW's state exists from here on
    state_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *(
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))])
    steps: dict[str, list[float]] = {mode: [] for mode in MODES}
    ratios: dict[str, list[float]] = {mode: [] for mode in MODES[1:]}  # per round: the load changes between rounds
    blocked: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
        tier = bcp.MemoryTier(local_dir=os.path.join(root, "tier"), replicas=0)  # one process: no peer
        for _ in range(args.rounds):
            medians = {}
            for mode in MODES:
                step_s, blocked_s = run_mode(mode, model, optimizer, x, args.steps, tier)
                steps[mode] += step_s[1:]
                blocked[mode] += blocked_s[1:]
                medians[mode] = statistics.median(step_s[1:])
            for mode in MODES[1:]:
                ratios[mode].append(medians[mode] / medians["none"])
        bcp.shutdown()
    alone = statistics.median(steps["none"])
    copy = bare_copy_s(model, optimizer)
    figures = {"state_mib": state_bytes / 2**20, "step_s": alone, "bare_copy_s": copy, "copy_share": copy / alone,
               **{f"{mode}_ratio": statistics.median(ratios[mode]) for mode in MODES[1:]},
               **{f"{mode}_blocking_s": statistics.median(blocked[mode]) for mode in MODES[1:]}}
    print(f"state {figures['state_mib']:.0f} MiB, step {alone * 1e3:.1f} ms, bare copy {copy * 1e3:.1f} ms "
          f"({figures['copy_share']:.1%} of the step)")
    for mode in MODES[1:]:
        print(f"{mode:>8}: step {figures[f'{mode}_ratio']:.3f}x without checkpoints, "
              f"blocking {figures[f'{mode}_blocking_s'] * 1e3:.1f} ms per save")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)


if __name__ == "__main__":
    sys.exit(main())
