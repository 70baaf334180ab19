"""Single process: the metrics record of a save and a load (handle, result, log line, INFO line, also
with no logging set up), the log read while being written, the report's summary, straggler
thresholds and JSON, and the heat map's layout and colour scale."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest
import torch
from matplotlib import colormaps

import bcp
from bcp.api.metrics import OpRecord, RankRecord, transfer_rate
from bcp.api.metrics_log import read_records
from bcp.engine.location import METRICS_DIR
from bcp.cli import main
from bcp.tools import report
from bcp.tools.heatmap import draw_heatmap, layout_of


def test_save_and_load_records_in_python_log_and_logger(tmp_path, caplog):
    state = {"model": {"w": torch.arange(1000, dtype=torch.float32)}}
    with caplog.at_level(logging.INFO, logger="bcp"):
        handle = bcp.save(tmp_path, state, async_save=True, topology={"dp": 0})  # the log is on by default
        handle.wait()
        result = bcp.load(tmp_path, {"model": {"w": torch.zeros(1000)}})
    saved, loaded = handle.metrics, result.metrics
    assert saved.ok and saved.bytes == 4000 and saved.ranks[0].topology == {"dp": 0}
    assert [name for name, _, _ in saved.ranks[0].phases] == [
        "collect", "plan", "plan.exchange", "plan.writes", "stage", "queue", "write", "queue", "commit"]
    assert saved.blocking_seconds < saved.seconds  # the async save returned before it committed
    assert [name for name, _, _ in loaded.ranks[0].phases] == [
        "metadata", "plan", "plan.state", "plan.staging", "plan.reads", "read", "agree", "apply", "confirm"]
    assert list(read_records(tmp_path)) == [saved.to_json(), loaded.to_json()]
    assert OpRecord.from_json(json.loads(json.dumps(saved.to_json()))) == saved
    summaries = [r.getMessage() for r in caplog.records if r.name == "bcp" and r.levelno == logging.INFO]
    assert len(summaries) == 2 and "bcp save" in summaries[0] and "bcp load" in summaries[1]
    # 4000 bytes in a fraction of a second: the rate in a unit that shows it, not "0.00 GB/s"
    assert all(re.search(r"\(\d[\d.]* (B|kB|MB)/s\), blocking", line) for line in summaries), summaries


def test_the_summary_line_takes_the_level_it_is_given(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="bcp"):
        bcp.save(tmp_path, {"model": {"w": torch.ones(4)}}, summary_log_level=logging.DEBUG)
    summaries = [r for r in caplog.records if r.name == "bcp" and "bcp save" in r.getMessage()]
    assert [r.levelno for r in summaries] == [logging.DEBUG]


def test_false_turns_the_log_off_and_a_path_redirects_it(tmp_path):
    bcp.save(tmp_path / "a", {"model": {"w": torch.ones(4)}}, metrics_log=False)
    assert sorted(os.listdir(tmp_path / "a")) == ["gen-00000001"]
    bcp.save(tmp_path / "b", {"model": {"w": torch.ones(4)}}, metrics_log=tmp_path / "logs" / "m.jsonl")
    assert sorted(os.listdir(tmp_path / "b")) == ["gen-00000001"]
    assert [r["op"] for r in read_records(tmp_path / "logs" / "m.jsonl")] == ["save"]


def test_the_log_of_a_role_lies_in_its_folder(tmp_path, capsys):
    bcp.save(tmp_path, {"model": {"w": torch.ones(4)}}, role="actor")
    assert sorted(os.listdir(tmp_path / "actor")) == [METRICS_DIR, "gen-00000001"]
    assert main(["report", str(tmp_path), "--role", "actor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == f"{tmp_path}/actor"


def test_a_line_being_written_is_skipped(tmp_path):
    log = tmp_path / "m.jsonl"
    complete = json.dumps(simulated(4).to_json())
    log.write_text(complete + "\n" + complete[:40])  # the writer is half-way through the second line
    assert len(list(read_records(log))) == 1


def test_report_summary_and_cli_json(tmp_path, capsys):
    log = tmp_path / "m.jsonl"
    log.write_text(json.dumps(simulated(6, slow=4).to_json()) + "\n")
    summary = report(log)
    assert (summary.straggler.slowest_rank, summary.straggler.phase) == (4, "write")
    assert summary.straggler.ratio == pytest.approx(3.0)
    assert main(["report", str(log), "--json", "--phase", "total"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranked_by"] == "total" and data["slowest"][0]["rank"] == 4
    assert {p["phase"] for p in data["phases"]} == {"plan", "write"}
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "no metrics log" in capsys.readouterr().err


def test_transfer_rates_keep_three_significant_digits_in_their_unit():
    assert [transfer_rate(n, 1.0) for n in (0, 512, 4000, 33_500, 5_720_000_000, 2.5e12)] == [
        "0 B/s", "512 B/s", "4 kB/s", "33.5 kB/s", "5.72 GB/s", "2.5 TB/s"]
    assert transfer_rate(4000, 0.0) == "0 B/s"


def test_a_load_that_finds_no_checkpoint_reports_no_generation(tmp_path, caplog):
    """A failed load's summary said ``bcp load  generation None``: the path was blank and the load
    never reached a generation."""
    (tmp_path / "ckpt").mkdir()
    with caplog.at_level(logging.INFO, logger="bcp"), pytest.raises(bcp.CheckpointError):
        bcp.load(tmp_path / "ckpt", {"model": {"w": torch.zeros(4)}})
    warnings = [r.getMessage() for r in caplog.records if r.name == "bcp" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"bcp load {tmp_path / 'ckpt'} failed in phase metadata: ")
    failed = OpRecord("load", "/ckpt", None, 2, 0.0, 0.01, 0.01, ok=False, failed_phase="metadata",
                      error="CheckpointNotFoundError: no gen-* folders",
                      ranks=[RankRecord(0, "host", 0, {}, [("metadata", 0.0, 0.01)])])
    text = report(failed).format()
    assert text.startswith("bcp load /ckpt: FAILED in phase metadata, 2 rank(s)") and "None" not in text


def test_a_straggler_needs_both_an_absolute_and_a_relative_gap(tmp_path, capsys):
    """At small scale the widest spread was always called a straggler: 3 ms of noise at 1.34x was
    ``straggler: rank 0 in read``."""
    noise = with_write_times([0.0090, 0.0121, 0.0090, 0.0090])  # 3 ms, 1.34x
    summary = report(noise)
    assert summary.straggler is None and (summary.widest.slowest_rank, summary.widest.phase) == (1, "write")
    assert "no straggler: the widest spread is rank 1 in write, 0.0031 s (1.34x) above the median" in summary.format()
    assert report(with_write_times([0.001, 0.02, 0.001, 0.001])).straggler is None  # 20x, but 19 ms
    assert report(with_write_times([10.0, 12.0, 10.0, 10.0])).straggler is None  # 2 s, but 1.2x
    slow = report(with_write_times([1.0, 3.0, 1.0, 1.0]))
    assert (slow.straggler.slowest_rank, slow.straggler.gap, slow.straggler.ratio) == (1, 2.0, 3.0)
    assert "straggler: rank 1 in write, 2.0000 s (3.00x) above the median" in slow.format()
    # the thresholds are the caller's
    assert report(noise, straggler_seconds=0.001, straggler_ratio=1.2).straggler.slowest_rank == 1
    log = tmp_path / "m.jsonl"
    log.write_text(json.dumps(noise.to_json()) + "\n")
    assert main(["report", str(log), "--json", "--straggler-seconds", "0.002", "--straggler-ratio", "1.3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["straggler"]["rank"] == 1 and data["straggler_thresholds"] == {"seconds": 0.002, "ratio": 1.3}
    assert main(["report", str(log), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["straggler"] is None and data["widest"]["rank"] == 1


def with_write_times(seconds: list[float]) -> OpRecord:
    ranks = [RankRecord(rank, "host", rank, {"dp": rank}, [("write", 0.0, s)], bytes=100)
             for rank, s in enumerate(seconds)]
    return OpRecord("save", "/ckpt", 1, len(seconds), 0.0, max(seconds), max(seconds), ranks=ranks)


def test_heatmap_layout_follows_the_topology():
    topologies = {r: {"pp": r // 4, "dp": (r // 2) % 2, "tp": r % 2} for r in range(8)}
    layout = layout_of(topologies)
    assert layout.panel_labels == ["tp = 0", "tp = 1"] and layout.row_labels == ["0", "1"]
    assert layout.cells[5] == (1, 1, 0)  # tp=1 panel, pp=1 row, dp=0 column
    assert len(set(layout.cells.values())) == 8
    colliding = {r: {"dp": 0} for r in range(3)}  # coordinates that do not tell ranks apart
    by_rank = layout_of(colliding)
    assert sorted(by_rank.cells.values()) == [(0, 0, 0), (0, 0, 1), (0, 1, 0)]
    # plain labels: each row names the ranks it holds (it read "rank (row start)" / "rank (offset)")
    assert (by_rank.row_title, by_rank.row_labels, by_rank.column_title) == ("ranks", ["0\u20131", "2"], "")


def simulated(world: int, slow: int | None = None) -> OpRecord:
    ranks = []
    for rank in range(world):
        write = 3.0 if rank == slow else 1.0
        ranks.append(RankRecord(rank, "host", rank, {"dp": rank}, [("plan", 0.0, 0.5), ("write", 0.5, 0.5 + write)],
                                bytes=100))
    return OpRecord("save", "/ckpt", 1, world, 0.0, 4.0, 4.0, ranks=ranks)


def test_heatmap_scale_starts_at_zero_and_shows_the_logs_operations(tmp_path):
    """The colour scale ran from the fastest rank to the slowest, so 2 ms between two ranks looked
    like a hot spot: from zero, two ranks within 0.2 % of each other get nearly one colour."""
    record = with_write_times([1.000, 1.002])
    drawn = draw_heatmap(report(record), tmp_path / "alone.png")
    pixels = matplotlib.image.imread(drawn.path)[..., :3]
    colours = []
    for rank in (0, 1):
        x, y = drawn.centres[rank]
        colours.append(pixels[int(y - 0.35 * drawn.cell_size[1]), int(x - 0.35 * drawn.cell_size[0])])
    assert np.abs(colours[0] - colours[1]).max() < 0.02
    top = np.array(colormaps["viridis"](1.0)[:3])
    assert np.abs(colours[1] - top).max() < 0.02
    # with the log's other operations, a timeline is drawn below the map
    earlier = with_write_times([0.5, 0.6])
    earlier.start = -600.0
    history = draw_heatmap(report([earlier, record]), tmp_path / "history.png", history=[earlier, record])
    assert history.size[1] > drawn.size[1] and history.size[0] >= drawn.size[0]


def test_setting_the_bcp_logger_to_info_prints_the_summary_without_any_logging_setup(tmp_path):
    """Python prints a library's records without configuration from WARNING up only, so
    ``setLevel(logging.INFO)`` alone printed nothing. Once the program configures logging, the line
    goes to its handlers alone, once."""
    script = f"""
import logging, torch, bcp
state = {{"model": {{"w": torch.ones(4)}}}}
bcp.save({str(tmp_path / 'a')!r}, state, metrics_log=False)                  # default level: silent
logging.getLogger("bcp").setLevel(logging.INFO)
bcp.save({str(tmp_path / 'b')!r}, state, metrics_log=False)                  # printed by bcp
logging.basicConfig(format="CONFIGURED %(message)s")
bcp.save({str(tmp_path / 'c')!r}, state, metrics_log=False)                  # the program's handler only
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "bcp save" in line]
    assert len(lines) == 2, done.stderr
    assert lines[0].startswith(f"bcp save {tmp_path / 'b'} generation 1: ")
    assert lines[1].startswith(f"CONFIGURED bcp save {tmp_path / 'c'} generation 1: ")


def test_the_report_table_stays_aligned_with_long_phase_names(tmp_path):
    """A real save's phases include ``plan.exchange`` (13 characters), which once pushed its row one
    column to the right of the others."""
    bcp.save(tmp_path, {"model": {"w": torch.ones(4)}})
    text = report(next((tmp_path / METRICS_DIR).glob("*.jsonl"))).format()
    table = [line for line in text.splitlines() if re.match(r"  \S+ +\d+ +[\d.]+ ", line) or "median s" in line]
    assert any(line.split()[0] == "plan.exchange" for line in table), text
    assert len({line.index(line.split()[1]) + len(line.split()[1]) for line in table}) == 1, text  # "ranks" ends alike
