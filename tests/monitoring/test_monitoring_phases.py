"""Every span of a save or a load lies in a named phase: the phases of the coordinating rank's record
follow one another and cover the operation's wall time up to a small residual (the clock reads
between them), and the parts of a phase (``plan.state``, ``plan.staging``, ``plan.reads`` of a
load) lie within it and cover it. The other ranks' records are sent on the last exchange, so theirs
cover the operation up to it. Synchronous and asynchronous saves, loads with and without
``read_once``, on one rank and on two FSDP2 ranks."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import bcp
from bcp.api.metrics import OpRecord, RankRecord
from bcp.api.phase_stats import is_part
from models import build, train

#: What may lie between phases: the reads of the clock, and a scheduler's hiccup on a busy machine.
RESIDUAL_S = 0.02
RESIDUAL_FRACTION = 0.05


def _operations(path: str) -> list[dict]:
    model, optimizer = build("fsdp2" if dist.is_initialized() else "plain", seed=1)
    train(model, optimizer, range(1))
    rank = dist.get_rank() if dist.is_initialized() else 0
    # 32 MiB of values: hashing them to write identical ones once took a save's time out of its phases
    state = {"model": model, "optimizer": optimizer, "notes": {"rank": rank, "blob": bytes(32 << 20)}}
    records = []
    for options in ({}, {"async_save": True}, {"async_save": True}):  # the second async save reuses the lane
        handle = bcp.save(path, state, **options)
        handle.wait()
        records.append(handle.metrics)
    for options in ({}, {"read_once": True}):
        records.append(bcp.load(path, state, **options).metrics)
    return [None if r is None else r.to_json() for r in records]


def _gaps(spans: list[tuple[str, float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] that no span covers."""
    covered, reached = 0.0, start
    for _, s, e in sorted(spans, key=lambda span: span[1]):
        s, e = max(s, reached), min(e, end)
        if e > s:
            covered += e - s
            reached = e
    return (end - start) - covered


def _allowed(seconds: float) -> float:
    return max(RESIDUAL_S, RESIDUAL_FRACTION * seconds)


def check_covered(record: OpRecord) -> None:
    own = record.ranks[0]
    phases = [p for p in own.phases if not is_part(p[0])]
    end = record.start + record.seconds
    assert _gaps(phases, record.start, end) <= _allowed(record.seconds), (record.op, own.phases, record.seconds)
    for rank in record.ranks[1:]:  # up to the last phase it sent, from its first
        mine = [p for p in rank.phases if not is_part(p[0])]
        first, last = min(s for _, s, _ in mine), max(e for _, _, e in mine)
        assert _gaps(mine, first, last) <= _allowed(last - first), (record.op, rank.rank, rank.phases)
    for rank in record.ranks:
        check_parts(rank)


def check_parts(rank: RankRecord) -> None:
    for name, start, end in rank.phases:
        parts = [p for p in rank.phases if p[0].startswith(f"{name}.")]
        if parts:
            assert all(start <= s and e <= end for _, s, e in parts)
            assert _gaps(parts, start, end) <= _allowed(end - start), (name, rank.phases)


def test_phases_cover_the_operations_on_one_rank(tmp_path):
    records = [OpRecord.from_json(r) for r in _operations(str(tmp_path / "ckpt"))]
    assert [r.op for r in records] == ["save"] * 3 + ["load"] * 2
    for record in records:
        check_covered(record)
    load = records[3].ranks[0]
    assert [n for n, _, _ in load.phases if n.startswith("plan.")] == ["plan.state", "plan.staging", "plan.reads"]


def test_phases_cover_the_operations_on_two_ranks(ranks, tmp_path):
    records = [OpRecord.from_json(r) for r in ranks(2).run(_operations, str(tmp_path / "ckpt"))[0]]
    for record in records:
        assert len(record.ranks) == 2
        check_covered(record)
    assert "plan.readers" in {n for n, _, _ in records[4].ranks[0].phases}


def test_a_wall_clock_stepped_back_during_the_operations_leaves_their_phases_nested(tmp_path, monkeypatch):
    """NTP may step the wall clock at any time (stepping this machine's clock would disturb every other
    process, so the test's own clock does it): from its second reading on it is 1 s behind."""
    real, readings = time.time, []

    def stepped() -> float:
        readings.append(None)
        return real() - (1.0 if len(readings) > 1 else 0.0)

    monkeypatch.setattr(time, "time", stepped)
    records = [OpRecord.from_json(r) for r in _operations(str(tmp_path / "ckpt"))]
    assert len(readings) > 1  # the step came within the operations
    for record in records:
        assert record.seconds > 0, record
        check_covered(record)
