"""One save's or load's time across ranks: per-phase median / p99 / max, the slowest ranks, and the
straggler, if there is one: the slowest rank of the phase where it is furthest above the median,
flagged only when that gap is large both in seconds and relative to the median (at small scale a
few milliseconds of noise are a large ratio and no straggler)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bcp.api.metrics import OpRecord, transfer_rate
from bcp.api.phase_stats import is_part
from bcp.tools.rank_bytes import ByteSummary, described, per_rank, summarize_bytes, why_slow
from bcp.tools.units import human_bytes

TOTAL = "total"
#: A straggler is at least this many seconds above its phase's median ...
STRAGGLER_SECONDS = 0.1
#: ... and at least this many times the median.
STRAGGLER_RATIO = 1.5
_SLOWEST = 5  # ranks listed as the slowest
# Phases that end in an exchange between the ranks are mostly waiting there: their longest time is
# the rank that arrived first, not the slow one (and only the coordinating rank runs commit and
# confirm). An asynchronous save's queue is its wait for earlier saves.
_EXCHANGES = frozenset({"plan", "plan.exchange", "plan.readers", "commit", "metadata", "agree", "confirm", "queue"})


@dataclass(frozen=True, slots=True)
class PhaseSummary:
    """One phase across the ranks that ran it, in seconds."""

    phase: str
    ranks: int
    median: float
    p99: float
    max: float
    slowest_rank: int

    @property
    def ratio(self) -> float:
        """max / median (1.0 when every rank took as long)."""
        return self.max / self.median if self.median > 0 else float("inf") if self.max > 0 else 1.0

    @property
    def gap(self) -> float:
        """Seconds the slowest rank took beyond the median."""
        return self.max - self.median


@dataclass(frozen=True, slots=True)
class Report:
    """The summary of one operation. ``phase``: the phase the slowest ranks are ranked by;
    ``widest``: the compared phase whose slowest rank is furthest above the median; ``straggler``:
    that phase when the gap passes both thresholds, else None; ``bytes``: what the ranks wrote or
    read, tensors and values apart."""

    record: OpRecord
    phases: list[PhaseSummary]
    phase: str
    slowest: list[tuple[int, float]]
    widest: PhaseSummary | None
    straggler: PhaseSummary | None
    straggler_seconds: float = STRAGGLER_SECONDS
    straggler_ratio: float = STRAGGLER_RATIO
    bytes: tuple[ByteSummary, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        record = self.record
        return {"op": record.op, "path": record.path, "generation": record.generation, "ok": record.ok,
                "failed_phase": record.failed_phase, "error": record.error, "world_size": record.world_size,
                "seconds": record.seconds, "blocking_seconds": record.blocking_seconds, "bytes": record.bytes,
                "phases": [{"phase": p.phase, "ranks": p.ranks, "median": p.median, "p99": p.p99, "max": p.max,
                            "slowest_rank": p.slowest_rank, "ratio": p.ratio} for p in self.phases],
                "ranked_by": self.phase, "slowest": [{"rank": r, "seconds": s} for r, s in self.slowest],
                "straggler": None if self.straggler is None else _described(self.straggler),
                "widest": None if self.widest is None else _described(self.widest),
                "straggler_thresholds": {"seconds": self.straggler_seconds, "ratio": self.straggler_ratio},
                "tensor_bytes": None if record.value_bytes is None else record.bytes - record.value_bytes,
                "value_bytes": record.value_bytes, "byte_summary": [b.to_dict() for b in self.bytes],
                "ranks": [{"rank": r.rank, "host": r.host, **per_rank(r)} for r in record.ranks]}

    def format(self) -> str:
        record = self.record
        outcome = "ok" if record.ok else f"FAILED in phase {record.failed_phase}"
        lines = [(f"{record.title}: {outcome}, {record.world_size} rank(s), {human_bytes(record.bytes)} in "
                  f"{record.seconds:.3f} s ({transfer_rate(record.bytes, record.seconds)}), blocking "
                  f"{record.blocking_seconds:.3f} s")]
        if record.error:
            lines.append(f"  error: {record.error}")
        # the first column as wide as its longest name (a phase such as "plan.exchange"), at least 12
        w = max([12, *(len(p.phase) for p in self.phases), *(len(b.kind) for b in self.bytes)])
        lines.append(f"  {'phase':<{w}} {'ranks':>5} {'median s':>10} {'p99 s':>10} {'max s':>10} {'max/med':>8}"
                     f"  slowest")
        for p in self.phases:
            lines.append(f"  {p.phase:<{w}} {p.ranks:>5} {p.median:>10.4f} {p.p99:>10.4f} {p.max:>10.4f} "
                         f"{p.ratio:>8.2f}  rank {p.slowest_rank}")
        if self.bytes:
            lines.append(f"  {'bytes':<{w}} {'ranks':>5} {'median':>10} {'max':>10} {'total':>10} {'max/med':>8}  most")
        for b in self.bytes:
            lines.append(f"  {b.kind:<{w}} {b.ranks:>5} {human_bytes(int(b.median)):>10} {human_bytes(b.max):>10} "
                         f"{human_bytes(b.total):>10} {b.ratio:>8.2f}  rank {b.most_rank}")
        ranks = {r.rank: r for r in self.record.ranks}
        lines.append(f"  slowest ranks in {self.phase}:")
        lines += [f"    rank {r:<5} {s:.4f} s  {described(ranks[r])}" for r, s in self.slowest]
        lines.append("  " + self.straggler_line())
        return "\n".join(lines)

    def straggler_line(self) -> str:
        """``straggler: rank 5 in write, 1.6726 s (2.95x) above the median`` or why there is none."""
        if self.straggler is not None:
            s = self.straggler
            why = why_slow(self.record, s.slowest_rank, s.phase, phase_seconds(self.record, s.phase))
            return (f"straggler: rank {s.slowest_rank} in {s.phase}, {s.gap:.4f} s ({s.ratio:.2f}x) above the median"
                    + (f"; {why}" if why else ""))
        thresholds = f"a straggler is {self.straggler_seconds:g} s and {self.straggler_ratio:g}x above it"
        if self.widest is None:
            return "no straggler: no phase ran on more than one rank"
        w = self.widest
        return (f"no straggler: the widest spread is rank {w.slowest_rank} in {w.phase}, {w.gap:.4f} s "
                f"({w.ratio:.2f}x) above the median ({thresholds})")


def phase_seconds(record: OpRecord, phase: str) -> dict[int, float]:
    """Each rank's seconds in ``phase`` (or in every phase, for ``"total"``), for the ranks that ran it."""
    out: dict[int, float] = {}
    for rank in record.ranks:
        seconds = rank.seconds()
        if phase == TOTAL:
            out[rank.rank] = sum(s for name, s in seconds.items() if not is_part(name))
        elif phase in seconds:
            out[rank.rank] = seconds[phase]
    return out


def summarize_record(record: OpRecord, phase: str | None = None, *, straggler_seconds: float = STRAGGLER_SECONDS,
                     straggler_ratio: float = STRAGGLER_RATIO) -> Report:
    """Per-phase statistics, the straggler (a slowest rank at least ``straggler_seconds`` and
    ``straggler_ratio`` times above its phase's median), and the slowest ranks in ``phase``
    (default: the widest phase)."""
    names = list(dict.fromkeys(name for rank in record.ranks for name, _, _ in rank.phases))
    phases = [_summary(name, phase_seconds(record, name)) for name in names]
    compared = [p for p in phases if p.ranks > 1 and p.phase not in _EXCHANGES] or [p for p in phases if p.ranks > 1]
    widest = max(compared, key=lambda p: p.gap) if compared else None
    straggler = widest if widest is not None and widest.gap >= straggler_seconds \
        and widest.ratio >= straggler_ratio else None
    ranked_by = phase or (widest.phase if widest is not None else TOTAL)
    seconds = phase_seconds(record, ranked_by)
    slowest = sorted(seconds.items(), key=lambda item: -item[1])[:_SLOWEST]
    return Report(record, phases, ranked_by, slowest, widest, straggler, straggler_seconds, straggler_ratio,
                  tuple(summarize_bytes(record)))


def _summary(name: str, by_rank: dict[int, float]) -> PhaseSummary:
    values = np.array(list(by_rank.values()))
    slowest = max(by_rank, key=by_rank.__getitem__)
    return PhaseSummary(name, len(values), float(np.median(values)), float(np.percentile(values, 99)),
                        float(values.max()), slowest)


def _described(p: PhaseSummary) -> dict[str, Any]:
    return {"rank": p.slowest_rank, "phase": p.phase, "seconds": p.max, "above_median": p.gap, "ratio": p.ratio}
