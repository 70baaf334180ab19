"""``bcp report``: one operation of a metrics log (the log every save and load writes, or
``handle.metrics``) summarized (``op_summary``), drawn as a heat map over the topology with the
log's operations over time, as a Gantt chart, and written as a Chrome trace."""

from __future__ import annotations

import os
from typing import Sequence

from bcp.api.metrics import OpRecord
from bcp.api.metrics_log import read_records
from bcp.errors import CheckpointError
from bcp.storage import Storage
from bcp.tools.heatmap import draw_heatmap
from bcp.tools.op_summary import STRAGGLER_RATIO, STRAGGLER_SECONDS, Report, summarize_record
from bcp.tools.trace import draw_gantt, write_trace

__all__ = ["Report", "load_records", "pick", "report"]


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


def report(source: "str | os.PathLike | Storage | OpRecord | Sequence[OpRecord]", *, index: int = -1,
           op: str | None = None, phase: str | None = None, heatmap: "str | os.PathLike | None" = None,
           trace: "str | os.PathLike | None" = None, gantt: "str | os.PathLike | None" = None,
           ranks: Sequence[int] | None = None, straggler_seconds: float = STRAGGLER_SECONDS,
           straggler_ratio: float = STRAGGLER_RATIO) -> Report:
    """Summarize one operation of a metrics log (``source``: a log file, the checkpoint path or URL
    beside which the log lies, or records); with ``heatmap``/``gantt`` draw those PNGs (matplotlib), with
    ``trace`` write the Chrome trace / Perfetto JSON. ``phase`` colours the heat map and ranks the
    slowest ranks (default: the phase with the widest spread; ``"total"`` for every phase); ``ranks``
    limits the Gantt chart. A straggler is flagged when the slowest rank of that phase is at least
    ``straggler_seconds`` and ``straggler_ratio`` times above the median."""
    records = load_records(source)
    summary = summarize_record(pick(records, index, op), phase, straggler_seconds=straggler_seconds,
                               straggler_ratio=straggler_ratio)
    if heatmap is not None:
        draw_heatmap(summary, heatmap, history=records)
    if gantt is not None:
        draw_gantt(summary.record, gantt, ranks)
    if trace is not None:
        write_trace(summary.record, trace)
    return summary
