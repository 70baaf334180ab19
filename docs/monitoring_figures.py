"""Draws the pictures of docs/monitoring.md from a simulated 8-rank save (PP=2 x DP=2 x TP=2, one
slow rank), in one process: ``python docs/monitoring_figures.py`` (needs matplotlib)."""

from __future__ import annotations

import os
import random

from bcp.api.metrics import OpRecord, RankRecord
from bcp.tools import report

HERE = os.path.dirname(os.path.abspath(__file__))
START = 1_700_000_000.0
SLOW_RANK = 5  # its storage path is overloaded: its write phase takes three times as long


def simulated_save() -> OpRecord:
    rng = random.Random(7)
    ranks = []
    for rank in range(8):
        pp, dp, tp = rank // 4, (rank // 2) % 2, rank % 2
        seconds = {"collect": 0.02 + rng.uniform(0, 0.01), "plan": 0.01 + rng.uniform(0, 0.005),
                   "stage": 0.15 + rng.uniform(0, 0.03), "write": 0.8 + rng.uniform(0, 0.15)}
        if rank == SLOW_RANK:
            seconds["write"] *= 3
        phases, at = [], START
        for name, length in seconds.items():
            phases.append((name, at, at + length))
            at += length
        ranks.append(RankRecord(rank, f"node{rank // 4}", rank % 4, {"pp": pp, "dp": dp, "tp": tp}, phases,
                                bytes=2_000_000_000))
    end = max(r.phases[-1][2] for r in ranks)
    # rank 0's commit phase waits in the commit exchange for every rank's report, then commits
    ranks[0].phases.append(("commit", ranks[0].phases[-1][2], end + 0.05))
    return OpRecord("save", "/ckpt/run7", 42, 8, START, end + 0.05 - START, 0.2, ranks=ranks)


if __name__ == "__main__":
    summary = report(simulated_save(), heatmap=os.path.join(HERE, "monitoring-heatmap.png"),
                     gantt=os.path.join(HERE, "monitoring-gantt.png"))
    print(summary.format())
