"""A 4-rank save with one rank slowed on purpose, alone or within a stall every rank's writes share:
the metrics record gathered to rank 0 names that rank as the straggler in its write phase, and the
heat map, Gantt chart and trace show it; a save that fails on one rank leaves a metrics line saying
where it failed."""

from __future__ import annotations

import json
import os
import time

import matplotlib.image
import numpy as np
import pytest
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
    """A real local storage on which rank 2's data-file write ends well after every other rank's, as
    on an overloaded storage path: once its own data is durable and every other rank's is too, it
    waits 0.4 s plus three times as long as the save has run since just before it began. A delay
    before the write would be absorbed by a stall that every rank's writes share (on a loaded
    machine, fsyncs can wait seconds together), and a fixed one would drown in it; this one stays
    the widest gap and 1.5x above the median whatever the others take.

    ``stall_until`` (a ``time.monotonic()`` moment, the same in every process of one machine) holds
    every rank's data-file writes until then: a shared stall, simulated because a real one cannot be
    produced on demand."""

    def __init__(self, root: str, signals: str, began: float, stall_until: float) -> None:
        super().__init__(root)
        self.signals = signals  # each other rank leaves a file here once its data is durable
        self.began = began  # rank 2's clock before the barrier that every rank left just before the save
        self.stall_until = stall_until

    def write_file(self, name, chunks):
        if "/data/" not in name:  # a rank writes one data file: 16 KiB is far below a file's share
            return super().write_file(name, chunks)
        writing = time.monotonic()
        time.sleep(max(0.0, self.stall_until - writing))
        super().write_file(name, chunks)
        rank = dist.get_rank()
        if rank != SLOW_RANK:
            open(os.path.join(self.signals, str(rank)), "x").close()
            return
        others = {str(r) for r in range(dist.get_world_size())} - {str(rank)}
        deadline = time.monotonic() + 60
        while not others <= set(os.listdir(self.signals)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(others - set(os.listdir(self.signals)))} wrote no data file in 60 s")
            time.sleep(0.01)
        # Every phase any other rank ran before its data was durable lies within `so_far`: each began
        # after the barrier, which no rank left before rank 2 reached it.
        so_far = time.monotonic() - self.began
        time.sleep(max(0.0, writing + 0.4 + 3 * so_far - time.monotonic()))


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


def slowed_save(path: str, signals: str, stall_s: float) -> list:
    # per-rank state: every rank writes a data file (replicated model tensors are written by one rank)
    state = {"extra_state": {"w": torch.arange(4096, dtype=torch.float32) + dist.get_rank()}}
    began = time.monotonic()
    dist.barrier()  # no rank leaves it, and so begins the save, before rank 2 came
    stall_until = [time.monotonic() + stall_s]
    dist.broadcast_object_list(stall_until, src=0)
    storage = SlowOnRank2(path, signals, began, stall_until[0])
    handle = bcp.save(storage, state, topology=topology(), metrics_log=True)
    result = bcp.load(path, {"extra_state": {"w": None}}, topology=topology(), metrics_log=True)
    saved, loaded = handle.metrics, result.metrics
    return [None if saved is None else saved.to_json(), None if loaded is None else loaded.to_json()]


@pytest.mark.parametrize("stall_s", [0.0, 1.0], ids=["alone", "in-a-stall-every-rank-shares"])
def test_slowed_rank_is_the_straggler_in_report_heatmap_and_trace(ranks, tmp_path, capsys, stall_s):
    path, signals = tmp_path / "ckpt", tmp_path / "written"
    signals.mkdir()
    results = ranks(4).run(slowed_save, str(path), str(signals), stall_s)
    assert all(saved is None and loaded is None for saved, loaded in results[1:])  # rank 0 holds the record
    saved, loaded = results[0]
    lines = list(read_records(path))
    assert [line["op"] for line in lines] == ["save", "load"] and lines == [saved, loaded]
    assert saved["ok"] and saved["world_size"] == 4 and [r["rank"] for r in saved["ranks"]] == [0, 1, 2, 3]
    assert [r["topology"] for r in saved["ranks"]] == [{"pp": r // 2, "dp": r % 2} for r in range(4)]
    assert all(r["bytes"] > 0 and r["local_rank"] == r["rank"] for r in saved["ranks"])
    assert [r["topology"] for r in loaded["ranks"]] == [r["topology"] for r in saved["ranks"]]

    summary = report(path, op="save", trace=tmp_path / "trace.json", gantt=tmp_path / "gantt.png")
    assert summary.straggler is not None, summary.format()
    assert (summary.straggler.slowest_rank, summary.straggler.phase) == (SLOW_RANK, "write")
    assert summary.phase == "write" and summary.slowest[0][0] == SLOW_RANK

    assert main(["report", str(path), "--op", "save"]) == 0
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
