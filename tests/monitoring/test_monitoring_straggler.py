"""A 4-rank save with one rank slowed on purpose: the metrics record gathered to rank 0 names that
rank as the straggler in its write phase, and the heat map, Gantt chart and trace show it; a save
that fails on one rank leaves a metrics line saying where it failed."""

from __future__ import annotations

import json
import time

import matplotlib.image
import numpy as np
import torch
import torch.distributed as dist
from matplotlib import colormaps

import bcp
from bcp.api.metrics_log import read_records
from bcp.cli import main
from bcp.storage import LocalStorage
from bcp.tools import report
from bcp.tools.heatmap import draw_heatmap

SLOW_RANK = 2


class SlowOnRank2(LocalStorage):
    """A real local storage whose data-file writes on rank 2 take 0.4 s longer, as on an overloaded
    storage path."""

    def write_file(self, name, chunks):
        if dist.get_rank() == SLOW_RANK and "/data/" in name:
            time.sleep(0.4)
        super().write_file(name, chunks)


class FailingOnRank1(LocalStorage):
    """Fault injection: a full disk on one rank cannot be produced for real on this machine (one
    healthy disk, run as root), so rank 1's data-file writes raise where a write would fail."""

    def write_file(self, name, chunks):
        if dist.get_rank() == 1 and "/data/" in name:
            raise OSError(28, "No space left on device")
        super().write_file(name, chunks)


def topology() -> dict[str, int]:
    rank = dist.get_rank()
    return {"pp": rank // 2, "dp": rank % 2}


def slowed_save(path: str) -> list:
    # per-rank state: every rank writes a data file (replicated model tensors are written by one rank)
    state = {"extra_state": {"w": torch.arange(4096, dtype=torch.float32) + dist.get_rank()}}
    handle = bcp.save(SlowOnRank2(path), state, topology=topology(), metrics_log=True)
    result = bcp.load(path, {"extra_state": {"w": None}}, topology=topology(), metrics_log=True)
    saved, loaded = handle.metrics, result.metrics
    return [None if saved is None else saved.to_json(), None if loaded is None else loaded.to_json()]


def test_slowed_rank_is_the_straggler_in_report_heatmap_and_trace(ranks, tmp_path, capsys):
    results = ranks(4).run(slowed_save, str(tmp_path))
    assert all(saved is None and loaded is None for saved, loaded in results[1:])  # rank 0 holds the record
    saved, loaded = results[0]
    lines = list(read_records(tmp_path))
    assert [line["op"] for line in lines] == ["save", "load"] and lines == [saved, loaded]
    assert saved["ok"] and saved["world_size"] == 4 and [r["rank"] for r in saved["ranks"]] == [0, 1, 2, 3]
    assert [r["topology"] for r in saved["ranks"]] == [{"pp": r // 2, "dp": r % 2} for r in range(4)]
    assert all(r["bytes"] > 0 and r["local_rank"] == r["rank"] for r in saved["ranks"])
    assert [r["topology"] for r in loaded["ranks"]] == [r["topology"] for r in saved["ranks"]]

    summary = report(tmp_path, op="save", trace=tmp_path / "trace.json", gantt=tmp_path / "gantt.png")
    assert (summary.straggler.slowest_rank, summary.straggler.phase) == (SLOW_RANK, "write")
    assert summary.phase == "write" and summary.slowest[0][0] == SLOW_RANK

    assert main(["report", str(tmp_path), "--op", "save"]) == 0
    assert f"straggler: rank {SLOW_RANK} in write" in capsys.readouterr().out

    trace = json.loads((tmp_path / "trace.json").read_text())
    check_trace_event_format(trace)
    writes = {e["pid"]: e["dur"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "write"}
    assert sorted(writes) == [0, 1, 2, 3] and max(writes, key=writes.get) == SLOW_RANK
    assert matplotlib.image.imread(tmp_path / "gantt.png").shape[2] in (3, 4)

    drawn = draw_heatmap(summary, tmp_path / "heat.png")
    pixels = matplotlib.image.imread(drawn.path)[..., :3]
    assert pixels.shape[:2] == (drawn.size[1], drawn.size[0])
    colours = {rank: cell_colour(pixels, drawn, rank) for rank in range(4)}
    top = np.array(colormaps["viridis"](1.0)[:3])
    assert np.abs(colours[SLOW_RANK] - top).max() < 0.02  # the slowest rank has the scale's top colour
    for rank in set(colours) - {SLOW_RANK}:
        assert np.abs(colours[rank] - colours[SLOW_RANK]).max() > 0.3


def cell_colour(pixels: np.ndarray, drawn, rank: int) -> np.ndarray:
    """The colour inside a rank's cell, off its centre where the label is written."""
    x, y = drawn.centres[rank]
    width, height = drawn.cell_size
    return pixels[int(y - 0.35 * height), int(x - 0.35 * width)]


def check_trace_event_format(trace: dict) -> None:
    """The trace-event format's required fields: every event has name, ph, pid, tid; complete events
    ("X") have numeric ts and dur >= 0 in microseconds; metadata events ("M") carry args."""
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    for event in trace["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= set(event) and event["ph"] in ("X", "M")
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "X":
            assert isinstance(event["ts"], (int, float)) and isinstance(event["dur"], (int, float))
            assert event["ts"] >= 0 and event["dur"] >= 0
        else:
            assert event["name"] in ("process_name", "process_sort_index") and "args" in event


def failed_save(path: str) -> str:
    state = {"extra_state": {"w": torch.full((64,), float(dist.get_rank()))}}  # differs per rank: every rank writes
    bcp.save(path, state, metrics_log=True)
    try:
        bcp.save(FailingOnRank1(path), state, metrics_log=True)
    except bcp.CheckpointError as exc:
        return type(exc).__name__
    return "saved"


def test_failed_save_leaves_a_metrics_line_saying_where(ranks, tmp_path):
    assert ranks(4).run(failed_save, str(tmp_path)) == ["StorageError"] * 4
    first, failed = read_records(tmp_path)
    assert first["ok"] and first["generation"] == 1
    assert not failed["ok"] and failed["generation"] == 2 and failed["failed_phase"] == "write"
    assert "rank 1" in failed["error"] and "No space left on device" in failed["error"]
    summary = report(tmp_path)
    assert not summary.record.ok and "FAILED in phase write" in summary.format()
