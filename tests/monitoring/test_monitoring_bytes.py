"""What each rank wrote and read, tensors' and values' bytes apart: in the metrics record, in
``bcp report``'s summary and ``--json``, and in the heat map below the time map. A 2-rank save where
the ranks' shares differ, checked against what the manifest says each rank's files hold."""

from __future__ import annotations

import json
import re

import matplotlib.image
import numpy as np
import torch
import torch.distributed as dist
from matplotlib import colormaps
from torch import nn

import bcp
from bcp.api.metrics import OpRecord
from bcp.cli import main
from bcp.integration import open_checkpoint
from bcp.tools import report
from bcp.tools.heatmap import draw_heatmap


def _state() -> dict:
    torch.manual_seed(0)
    rank = dist.get_rank()
    # the model is replicated (its writes are shared out); each rank's values differ in size
    return {"model": nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)),
            "notes": {"seen": list(range(2000 * (rank + 1))), "rank": rank}}


def save_and_load(path: str) -> list:
    handle = bcp.save(path, _state(), topology={"dp": dist.get_rank()})
    result = bcp.load(path, _state(), topology={"dp": dist.get_rank()})
    return [None if m is None else m.to_json() for m in (handle.metrics, result.metrics)]


def written_by_rank(path: str) -> dict[int, dict[str, int]]:
    """From the manifest alone: the tensor and value bytes in each rank's data files."""
    manifest = open_checkpoint(path).manifest
    rank_of = [int(re.match(r"data/(\d+)-", name).group(1)) for name in manifest.files]
    out = {r: {"tensor_bytes": 0, "value_bytes": 0} for r in set(rank_of)}
    for where in {s.bytes for e in manifest.tensors.values() for s in e.shards}:
        out[rank_of[where.file]]["tensor_bytes"] += where.nbytes
    for where in {record for e in manifest.objects.values() for record, _ in e.records}:
        out[rank_of[where.file]]["value_bytes"] += where.nbytes
    return out


def test_each_ranks_bytes_are_in_the_record_the_summary_the_json_and_the_heat_map(ranks, tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    saved, loaded = ranks(2).run(save_and_load, path)[0]
    expected = written_by_rank(path)
    assert all(expected[r]["tensor_bytes"] > 0 for r in (0, 1)) and expected[1]["value_bytes"] > expected[0]["value_bytes"]
    for rank in saved["ranks"]:
        assert {k: rank[k] for k in ("tensor_bytes", "value_bytes")} == expected[rank["rank"]]
        assert rank["bytes"] == rank["tensor_bytes"] + rank["value_bytes"]
    model_bytes = sum(p.numel() * 4 for p in nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).parameters())
    for rank in loaded["ranks"]:  # every rank reads the whole model and its own values
        assert rank["tensor_bytes"] == model_bytes and rank["value_bytes"] == expected[rank["rank"]]["value_bytes"]

    assert main(["report", path, "--op", "save", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [{k: r[k] for k in ("rank", "tensor_bytes", "value_bytes")} for r in data["ranks"]] == [
        {"rank": r, **expected[r]} for r in (0, 1)]
    assert data["value_bytes"] == sum(e["value_bytes"] for e in expected.values())
    values = next(b for b in data["byte_summary"] if b["kind"] == "values")
    assert values["most_rank"] == 1 and values["max"] == expected[1]["value_bytes"]

    assert main(["report", path, "--op", "save"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^  tensors +2 ", text, re.M) and re.search(r"^  values +2 .* rank 1$", text, re.M)
    assert re.search(r"slowest ranks in \w+:\n    rank \d +\d+\.\d+ s  [\d.]+ KiB of tensors, [\d.]+ KiB of values\n", text)

    summary = report(path, op="save")
    drawn = draw_heatmap(summary, tmp_path / "heat.png")
    pixels = matplotlib.image.imread(drawn.path)[..., :3]
    most = max((0, 1), key=lambda r: sum(expected[r].values()))
    colour = {r: _cell(pixels, drawn.byte_centres[r], drawn.cell_size) for r in (0, 1)}
    assert np.abs(colour[most] - np.array(colormaps["viridis"](1.0)[:3])).max() < 0.02


def test_a_record_of_an_older_version_has_no_split_and_still_reports(tmp_path, capsys):
    log = tmp_path / "old.jsonl"
    record = {"op": "save", "path": "/ckpt", "generation": 1, "world_size": 1, "start": 0.0, "seconds": 1.0,
              "ranks": [{"rank": 0, "phases": [{"name": "write", "start": 0.0, "end": 1.0}], "bytes": 1000}]}
    log.write_text(json.dumps(record) + "\n")
    assert OpRecord.from_json(record).ranks[0].tensor_bytes is None
    assert main(["report", str(log), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"][0]["bytes"] == 1000 and data["ranks"][0]["value_bytes"] is None
    assert data["byte_summary"] == []


def _cell(pixels: np.ndarray, centre: tuple[float, float], size: tuple[float, float]) -> np.ndarray:
    """The colour inside a cell, off its centre where the label is written."""
    return pixels[int(centre[1] - 0.35 * size[1]), int(centre[0] - 0.35 * size[0])]
