"""Draws the pictures of docs/monitoring.md from a simulated 8-rank job (PP=2 x DP=2 x TP=2): a load,
then a save every ten minutes, the last with one slow rank; in one process:
``python docs/monitoring_figures.py`` (needs matplotlib)."""

from __future__ import annotations

import os
import random

from bcp.api.metrics import OpRecord, RankRecord
from bcp.tools import report

HERE = os.path.dirname(os.path.abspath(__file__))
START = 1_700_000_000.0
SLOW_RANK = 5  # its storage path is overloaded: its write phase takes three times as long


def simulated_op(op: str, generation: int, start: float, slow_rank: int | None, rng: random.Random) -> OpRecord:
    lengths = ({"collect": (0.02, 0.01), "plan": (0.01, 0.005), "stage": (0.15, 0.03), "write": (0.8, 0.15)}
               if op == "save" else
               {"metadata": (0.03, 0.01), "plan": (0.02, 0.005), "read": (1.1, 0.2), "agree": (0.01, 0.005),
                "apply": (0.1, 0.02)})
    ranks = []
    for rank in range(8):
        pp, dp, tp = rank // 4, (rank // 2) % 2, rank % 2
        seconds = {name: base + rng.uniform(0, spread) for name, (base, spread) in lengths.items()}
        if rank == slow_rank:
            seconds["write"] *= 3
        phases, at = [], start
        for name, length in seconds.items():
            phases.append((name, at, at + length))
            at += length
        # the data-parallel ranks of the first stage also save the dataloader's position (values)
        values = 3_000_000 if pp == 0 else 40_000
        ranks.append(RankRecord(rank, f"node{rank // 4}", rank % 4, {"pp": pp, "dp": dp, "tp": tp}, phases,
                                bytes=2_000_000_000 + values, value_bytes=values))
    end = max(r.phases[-1][2] for r in ranks)
    if op == "save":
        # rank 0's commit phase waits in the commit exchange for every rank's report, then commits
        ranks[0].phases.append(("commit", ranks[0].phases[-1][2], end + 0.05))
        end += 0.05
    return OpRecord(op, "/ckpt/run7", generation, 8, start, end - start, 0.2 if op == "save" else end - start,
                    ranks=ranks)


def simulated_job() -> list[OpRecord]:
    """A resume (load of generation 37), then saves of generations 38 to 42 ten minutes apart."""
    rng = random.Random(7)
    records = [simulated_op("load", 37, START, None, rng)]
    for i, generation in enumerate(range(38, 43)):
        records.append(simulated_op("save", generation, START + 600 * (i + 1), SLOW_RANK if generation == 42 else None,
                                    rng))
    return records


if __name__ == "__main__":
    summary = report(simulated_job(), heatmap=os.path.join(HERE, "monitoring-heatmap.png"),
                     gantt=os.path.join(HERE, "monitoring-gantt.png"))
    print(summary.format())
