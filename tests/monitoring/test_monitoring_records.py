"""Single process: the metrics record of a save and a load (handle, result, log line, INFO line),
the log read while being written, the report's summary and JSON, and the heat map's layout."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import bcp
from bcp.api.metrics import OpRecord, RankRecord
from bcp.api.metrics_log import read_records
from bcp.engine.location import METRICS_DIR
from bcp.cli import main
from bcp.tools import report
from bcp.tools.heatmap import layout_of


def test_save_and_load_records_in_python_log_and_logger(tmp_path, caplog):
    state = {"model": {"w": torch.arange(1000, dtype=torch.float32)}}
    with caplog.at_level(logging.INFO, logger="bcp"):
        handle = bcp.save(tmp_path, state, async_save=True, topology={"dp": 0})  # the log is on by default
        handle.wait()
        result = bcp.load(tmp_path, {"model": {"w": torch.zeros(1000)}})
    saved, loaded = handle.metrics, result.metrics
    assert saved.ok and saved.bytes == 4000 and saved.ranks[0].topology == {"dp": 0}
    assert [name for name, _, _ in saved.ranks[0].phases] == ["collect", "plan", "stage", "write", "commit"]
    assert saved.blocking_seconds < saved.seconds  # the async save returned before it committed
    assert [name for name, _, _ in loaded.ranks[0].phases] == ["metadata", "plan", "read", "apply"]
    assert list(read_records(tmp_path)) == [saved.to_json(), loaded.to_json()]
    assert OpRecord.from_json(json.loads(json.dumps(saved.to_json()))) == saved
    summaries = [r.getMessage() for r in caplog.records if r.name == "bcp" and r.levelno == logging.INFO]
    assert len(summaries) == 2 and "bcp save" in summaries[0] and "bcp load" in summaries[1]
    assert all("GB/s" in line and "blocking" in line for line in summaries)


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


def test_heatmap_layout_follows_the_topology():
    topologies = {r: {"pp": r // 4, "dp": (r // 2) % 2, "tp": r % 2} for r in range(8)}
    layout = layout_of(topologies)
    assert layout.panel_labels == ["tp = 0", "tp = 1"] and layout.row_labels == ["0", "1"]
    assert layout.cells[5] == (1, 1, 0)  # tp=1 panel, pp=1 row, dp=0 column
    assert len(set(layout.cells.values())) == 8
    colliding = {r: {"dp": 0} for r in range(3)}  # coordinates that do not tell ranks apart
    assert sorted(layout_of(colliding).cells.values()) == [(0, 0, 0), (0, 0, 1), (0, 1, 0)]


def simulated(world: int, slow: int | None = None) -> OpRecord:
    ranks = []
    for rank in range(world):
        write = 3.0 if rank == slow else 1.0
        ranks.append(RankRecord(rank, "host", rank, {"dp": rank}, [("plan", 0.0, 0.5), ("write", 0.5, 0.5 + write)],
                                bytes=100))
    return OpRecord("save", "/ckpt", 1, world, 0.0, 4.0, 4.0, ranks=ranks)
