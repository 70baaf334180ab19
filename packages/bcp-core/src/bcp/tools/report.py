"""Where a save's or load's time went, across ranks: per-phase median / p99 / max, the slowest ranks
and the straggler (the rank furthest above the median, in the phase where that gap is largest),
from an operation's metrics record (the metrics log every save and load writes, or ``handle.metrics``).
``bcp report`` prints it and draws the heat map, the Gantt chart and the Chrome trace."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from bcp.api.metrics import OpRecord
from bcp.api.metrics_log import read_records
from bcp.errors import CheckpointError
from bcp.storage import Storage
from bcp.tools.units import human_bytes

TOTAL = "total"
_SLOWEST = 5  # ranks listed as the slowest


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
        """Straggler ratio: max / median (1.0 when every rank took as long)."""
        return self.max / self.median if self.median > 0 else float("inf") if self.max > 0 else 1.0


@dataclass(frozen=True, slots=True)
class Report:
    """The summary of one operation; ``phase`` is the phase the slowest ranks are ranked by."""

    record: OpRecord
    phases: list[PhaseSummary]
    phase: str
    slowest: list[tuple[int, float]]
    straggler: PhaseSummary | None

    def to_dict(self) -> dict[str, Any]:
        record = self.record
        return {"op": record.op, "path": record.path, "generation": record.generation, "ok": record.ok,
                "failed_phase": record.failed_phase, "error": record.error, "world_size": record.world_size,
                "seconds": record.seconds, "blocking_seconds": record.blocking_seconds, "bytes": record.bytes,
                "phases": [{"phase": p.phase, "ranks": p.ranks, "median": p.median, "p99": p.p99, "max": p.max,
                            "slowest_rank": p.slowest_rank, "ratio": p.ratio} for p in self.phases],
                "ranked_by": self.phase, "slowest": [{"rank": r, "seconds": s} for r, s in self.slowest],
                "straggler": None if self.straggler is None else {
                    "rank": self.straggler.slowest_rank, "phase": self.straggler.phase,
                    "seconds": self.straggler.max, "ratio": self.straggler.ratio}}

    def format(self) -> str:
        record = self.record
        rate = record.bytes / record.seconds / 1e9 if record.seconds > 0 else 0.0
        outcome = "ok" if record.ok else f"FAILED in phase {record.failed_phase}"
        lines = [(f"bcp {record.op} {record.path} generation {record.generation}: {outcome}, {record.world_size} "
                  f"rank(s), {human_bytes(record.bytes)} in {record.seconds:.3f} s ({rate:.2f} GB/s), blocking "
                  f"{record.blocking_seconds:.3f} s")]
        if record.error:
            lines.append(f"  error: {record.error}")
        lines.append(f"  {'phase':<12} {'ranks':>5} {'median s':>10} {'p99 s':>10} {'max s':>10} {'max/med':>8}"
                     f"  slowest")
        for p in self.phases:
            lines.append(f"  {p.phase:<12} {p.ranks:>5} {p.median:>10.4f} {p.p99:>10.4f} {p.max:>10.4f} "
                         f"{p.ratio:>8.2f}  rank {p.slowest_rank}")
        listed = ", ".join(f"rank {r} ({s:.4f} s)" for r, s in self.slowest)
        lines.append(f"  slowest ranks in {self.phase}: {listed}")
        if self.straggler is not None:
            s = self.straggler
            lines.append(f"  straggler: rank {s.slowest_rank} in {s.phase} ({s.max:.4f} s, {s.ratio:.2f}x the "
                         f"median)")
        return "\n".join(lines)


def load_records(source: "str | os.PathLike | Storage | OpRecord | Sequence[OpRecord]") -> list[OpRecord]:
    """Records from a metrics log file, the log beside the checkpoints at a path or URL, or records
    in hand."""
    if isinstance(source, OpRecord):
        return [source]
    if not isinstance(source, (str, os.PathLike, Storage)):
        return list(source)
    where = source.root if isinstance(source, Storage) else os.fspath(source)
    try:
        return [OpRecord.from_json(data) for data in read_records(source)]
    except FileNotFoundError:
        raise CheckpointError("no metrics log (nothing was saved or loaded here with metrics_log on; "
                              "or name the log file)", path=where) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"not a bcp metrics log: {exc}", path=where) from None


def pick(records: Sequence[OpRecord], index: int = -1, op: str | None = None) -> OpRecord:
    """The ``index``-th record (default: the last) among those of operation ``op`` (save/load)."""
    chosen = [r for r in records if op is None or r.op == op]
    if not chosen:
        raise CheckpointError(f"the metrics log has no {op or 'operation'} record")
    try:
        return chosen[index]
    except IndexError:
        raise CheckpointError(f"no record {index}: the metrics log has {len(chosen)}") from None


def phase_seconds(record: OpRecord, phase: str) -> dict[int, float]:
    """Each rank's seconds in ``phase`` (or in every phase, for ``"total"``), for the ranks that ran it."""
    out: dict[int, float] = {}
    for rank in record.ranks:
        seconds = rank.seconds()
        if phase == TOTAL:
            out[rank.rank] = sum(seconds.values())
        elif phase in seconds:
            out[rank.rank] = seconds[phase]
    return out


_EXCHANGES = frozenset({"plan", "commit", "metadata"})


def summarize_record(record: OpRecord, phase: str | None = None) -> Report:
    """Per-phase statistics, the straggler, and the slowest ranks in ``phase`` (default: the
    straggler's phase)."""
    names = list(dict.fromkeys(name for rank in record.ranks for name, _, _ in rank.phases))
    phases = [_summary(name, phase_seconds(record, name)) for name in names]
    # The straggler's phase is where the slowest rank is furthest above the median. A phase only the
    # coordinating rank runs (commit) has no one to compare with, and a phase that ends in an exchange
    # (plan, a load's metadata) is mostly waiting: there the longest time is the rank that arrived first.
    compared = [p for p in phases if p.ranks > 1 and p.phase not in _EXCHANGES] or [p for p in phases if p.ranks > 1]
    straggler = max(compared, key=lambda p: p.max - p.median) if compared else None
    ranked_by = phase or (straggler.phase if straggler is not None else TOTAL)
    seconds = phase_seconds(record, ranked_by)
    slowest = sorted(seconds.items(), key=lambda item: -item[1])[:_SLOWEST]
    return Report(record, phases, ranked_by, slowest, straggler)


def _summary(name: str, by_rank: dict[int, float]) -> PhaseSummary:
    values = np.array(list(by_rank.values()))
    slowest = max(by_rank, key=by_rank.__getitem__)
    return PhaseSummary(name, len(values), float(np.median(values)), float(np.percentile(values, 99)),
                        float(values.max()), slowest)


def report(source: "str | os.PathLike | Storage | OpRecord | Sequence[OpRecord]", *, index: int = -1,
           op: str | None = None, phase: str | None = None, heatmap: "str | os.PathLike | None" = None,
           trace: "str | os.PathLike | None" = None, gantt: "str | os.PathLike | None" = None,
           ranks: Sequence[int] | None = None) -> Report:
    """Summarize one operation of a metrics log (``source``: a log file, the checkpoint path or URL
    beside which the log lies, or records); with ``heatmap``/``gantt`` draw those PNGs (matplotlib), with
    ``trace`` write the Chrome trace / Perfetto JSON. ``phase`` colours the heat map and ranks the
    slowest ranks (default: the straggler's phase; ``"total"`` for every phase); ``ranks`` limits
    the Gantt chart."""
    summary = summarize_record(pick(load_records(source), index, op), phase)
    if heatmap is not None:
        from bcp.tools.heatmap import draw_heatmap
        draw_heatmap(summary, heatmap)
    if gantt is not None:
        from bcp.tools.trace import draw_gantt
        draw_gantt(summary.record, gantt, ranks)
    if trace is not None:
        from bcp.tools.trace import write_trace
        write_trace(summary.record, trace)
    return summary
