"""What each rank of one save or load moved: the bytes it wrote or read, tensors' and values' apart,
and (loads with ``read_once``) the bytes it received from other ranks instead of reading them;
summarized across ranks, and set against a slow rank's time: did it have more to move, or move
its share more slowly?"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bcp.api.metrics import OpRecord, RankRecord, transfer_rate
from bcp.tools.units import human_bytes

#: The phase in which each operation moves its bytes to or from storage.
DATA_PHASE = {"save": "write", "load": "read"}
TENSORS, VALUES, RECEIVED = "tensors", "values", "received"
#: A slow rank moved "a larger share" from this many times the median rank's bytes, and its share
#: "more slowly" at this fraction of the median rate or below.
_LARGER, _SLOWER = 1.25, 0.8


@dataclass(frozen=True, slots=True)
class ByteSummary:
    """One kind of bytes across the ranks: median, maximum and the rank that moved the most."""

    kind: str
    ranks: int
    total: int
    median: float
    max: int
    most_rank: int

    @property
    def ratio(self) -> float:
        """max / median (1.0 when every rank moved as much)."""
        return self.max / self.median if self.median > 0 else float("inf") if self.max > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranks": self.ranks, "total": self.total, "median": self.median, "max": self.max,
                "most_rank": self.most_rank, "ratio": self.ratio}


def per_rank(rank: RankRecord) -> dict[str, int | None]:
    """A rank's bytes as the record names them; tensors' and values' are None in records that did
    not tell them apart."""
    return {"bytes": rank.bytes, "tensor_bytes": rank.tensor_bytes, "value_bytes": rank.value_bytes,
            "received_bytes": rank.received_bytes}


_FIELDS = {TENSORS: "tensor_bytes", VALUES: "value_bytes", RECEIVED: "received_bytes"}


def summarize_bytes(record: OpRecord) -> list[ByteSummary]:
    """Tensors', values' and (where any rank received some) received bytes across the ranks."""
    kinds = [TENSORS, VALUES] + ([RECEIVED] if any(r.received_bytes for r in record.ranks) else [])
    out = []
    for kind in kinds:
        by_rank = {r.rank: per_rank(r)[_FIELDS[kind]] for r in record.ranks}
        known = {rank: n for rank, n in by_rank.items() if n is not None}
        if known:
            values = np.array(list(known.values()), dtype=np.float64)
            most = max(known, key=known.__getitem__)
            out.append(ByteSummary(kind, len(known), int(values.sum()), float(np.median(values)), known[most], most))
    return out


def described(rank: RankRecord) -> str:
    """``1.9 GiB of tensors, 3.1 KiB of values`` (with the bytes received from other ranks, if any)."""
    if rank.value_bytes is None:
        text = human_bytes(rank.bytes)
    else:
        text = f"{human_bytes(rank.tensor_bytes or 0)} of tensors, {human_bytes(rank.value_bytes)} of values"
    return text + (f", {human_bytes(rank.received_bytes)} received" if rank.received_bytes else "")


def why_slow(record: OpRecord, rank: int, phase: str, seconds: dict[int, float]) -> str | None:
    """For a slow rank in the phase that moves the bytes: its bytes and rate against the median
    rank's, which tells a larger share (more bytes, the usual rate) from slower storage or host (the
    usual bytes, a lower rate). None for other phases."""
    if DATA_PHASE.get(record.op) != phase or rank not in seconds:
        return None
    moved = {r.rank: r.bytes for r in record.ranks if r.rank in seconds}
    rates = {r: moved[r] / s for r, s in seconds.items() if s > 0 and r in moved}
    median_bytes = float(np.median(list(moved.values())))
    median_rate = float(np.median(list(rates.values()))) if rates else 0.0
    verb = "wrote" if record.op == "save" else "read"
    share = moved[rank] / median_bytes if median_bytes > 0 else float("inf")
    pace = rates.get(rank, 0.0) / median_rate if median_rate > 0 else 1.0
    verdict = "a larger share" if share >= _LARGER else "the usual share, moved more slowly" if pace <= _SLOWER else ""
    return (f"rank {rank} {verb} {human_bytes(moved[rank])} ({share:.2f}x the median rank's) at "
            f"{transfer_rate(moved[rank], seconds[rank])} ({pace:.2f}x the median rate)"
            + (f": {verdict}" if verdict else ""))
