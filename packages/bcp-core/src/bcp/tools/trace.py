"""One operation's per-rank timeline: as a Chrome trace / Perfetto JSON (the trace-event format:
one process per rank, one complete ("X") event per phase, times in microseconds from when the
first rank began; opens in ui.perfetto.dev and chrome://tracing) and as a PNG Gantt chart."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from bcp.api.metrics import OpRecord, RankRecord
from bcp.api.phase_stats import is_part

_GANTT_RANKS = 64  # ranks drawn when none are chosen


def trace_events(record: OpRecord) -> dict[str, Any]:
    """The trace-event JSON object of ``record``."""
    events: list[dict[str, Any]] = []
    origin = _origin(record)
    for rank in record.ranks:
        events.append({"name": "process_name", "ph": "M", "pid": rank.rank, "tid": 0,
                       "args": {"name": _rank_label(rank)}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank.rank, "tid": 0,
                       "args": {"sort_index": rank.rank}})
        for name, start, end in rank.phases:
            events.append({"name": name, "cat": record.op, "ph": "X", "pid": rank.rank, "tid": 0,
                           "ts": round((start - origin) * 1e6, 3), "dur": round((end - start) * 1e6, 3),
                           "args": {"bytes": rank.bytes, "host": rank.host}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"op": record.op, "path": record.path, "generation": record.generation,
                          "ok": record.ok, "failed_phase": record.failed_phase, "error": record.error}}


def write_trace(record: OpRecord, path: "str | os.PathLike") -> None:
    """Write ``record``'s timeline as Chrome trace / Perfetto JSON."""
    with open(path, "w", encoding="utf-8") as out:
        json.dump(trace_events(record), out)


def draw_gantt(record: OpRecord, path: "str | os.PathLike", ranks: Sequence[int] | None = None,
               dpi: int = 100) -> None:
    """Draw the phases of ``ranks`` (default: the first 64) against time as a PNG Gantt chart."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = record.ranks[:_GANTT_RANKS] if ranks is None else [r for r in record.ranks if r.rank in set(ranks)]
    names = list(dict.fromkeys(name for rank in chosen for name, _, _ in rank.phases))
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}
    origin = _origin(record)
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.35 * len(chosen)), dpi=dpi, layout="constrained")
    for row, rank in enumerate(chosen):  # a phase's parts in the lower half of its bar, over it
        for name, start, end in sorted(rank.phases, key=lambda phase: is_part(phase[0])):
            ax.broken_barh([((start - origin) * 1e3, (end - start) * 1e3)],
                           (row, 0.4) if is_part(name) else (row - 0.4, 0.8), facecolors=colours[name])
    ax.set_yticks(range(len(chosen)), [_rank_label(r) for r in chosen], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"time since the first rank started the {record.op} (ms)")
    ax.set_ylabel("rank")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names], labels=names,
              title="phase", loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{record.title}: phases per rank")
    fig.savefig(os.fspath(path), dpi=dpi)
    plt.close(fig)


def _origin(record: OpRecord) -> float:
    """Time zero: where the first rank began (ranks enter an operation at different times)."""
    return min([record.start, *(start for rank in record.ranks for _, start, _ in rank.phases)])


def _rank_label(rank: RankRecord) -> str:
    coordinates = " ".join(f"{k}={v}" for k, v in sorted(rank.topology.items()))
    return f"rank {rank.rank}" + (f" ({coordinates})" if coordinates else "")
