"""``bcp inspect`` and ``bcp verify``: what a checkpoint holds, and every way it can be broken."""

from __future__ import annotations

import io
import json
import os
import shutil

import pytest
import torch

import bcp
from bcp.cli import main
from bcp.layout.manifest import TensorEntry
from bcp.tools import TerminalProgress, open_checkpoint, progress_for, summarize, verify_checkpoint
from tools_checkpoints import data_files, flip_byte, sharded_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ckpt")
    sharded_checkpoint(path)
    return path


def test_inspect_describes_entries_layouts_and_sizes(ckpt, capsys):
    assert main(["inspect", ckpt, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["generations"] == [{"generation": 1, "committed": True, "created": summary["created"],
                                       "step": None}]
    assert (summary["format_version"], summary["framework"], summary["world_size"]) == (2, "plain", 1)
    assert summary["components"] == {"model": {"tensors": 6, "values": 1}, "extra_state": {"tensors": 1, "values": 1}}
    rows = {t["name"]: t for t in summary["tensors"]}
    assert rows["model/embed.weight"] == {"name": "model/embed.weight", "dtype": "float32", "shape": [10, 6],
                                          "numel": 60, "nbytes": 240, "stored_nbytes": 240, "ratio": 1.0,
                                          "shards": 2, "layout": "dim 0 / 2"}
    assert rows["model/grid.weight"]["layout"] == "dim 0 / 2 x dim 1 / 2"
    assert rows["model/flat.weight"]["layout"].endswith("irregular boxes")
    assert rows["model/scale"]["layout"] == "whole" and rows["model/scale"]["shape"] == []
    assert summary["tensor_bytes"] == sum(t["nbytes"] for t in summary["tensors"])
    assert {v["name"] for v in summary["values"]} == {"extra_state", "model/note"}


def test_inspect_filters_and_prints_a_table(ckpt, capsys):
    assert main(["inspect", ckpt, "--filter", "model/*.weight"]) == 0
    out = capsys.readouterr().out
    assert "generation   1 (all generations: 1 committed at " in out
    assert "model/grid.weight" in out and "model/positions" not in out and "extra_state  " not in out
    assert capsys.readouterr().err == ""  # no progress output when not on a terminal


def test_inspect_lists_kept_generations_with_time_and_step(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    for step in (100, 200):
        bcp.save(path, {"model": {"w": torch.full((2,), float(step))}}, step=step, keep_generations=3)
    bcp.save(path, {"model": {"w": torch.zeros(2)}}, keep_generations=3)
    assert main(["inspect", path, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [(g["generation"], g["step"]) for g in summary["generations"]] == [(1, 100), (2, 200), (3, None)]
    assert all(g["created"].endswith(" UTC") for g in summary["generations"])
    assert main(["inspect", path, "--generation", "2"]) == 0
    out = capsys.readouterr().out
    assert "generation   2, step 200 (all generations: 1 committed at " in out
    assert ", step 100; 2 committed at " in out and ", step 200; 3 committed at " in out


def test_verify_passes_an_intact_checkpoint(ckpt, capsys):
    assert main(["verify", ckpt]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK:") and "7 tensors and 2 values intact" in out


def test_verify_names_the_tensor_whose_bytes_are_corrupted(ckpt, capsys):
    flip_byte(ckpt, "model/grid.weight", shard=1, at=5)

    assert main(["verify", ckpt, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["tensors"] == 6 and report["values"] == 2
    assert [p["entry"] for p in report["problems"]] == ["model/grid.weight"]
    assert "checksum mismatch" in report["problems"][0]["message"]
    with pytest.raises(bcp.CorruptCheckpointError):  # and reading that tensor refuses the bad bytes
        open_checkpoint(ckpt).read("model/grid.weight")


def test_verify_reports_a_truncated_and_a_missing_data_file(ckpt, capsys):
    path = data_files(ckpt)[-1]
    name = os.path.relpath(path, os.path.join(ckpt, "gen-00000001"))
    os.truncate(path, os.path.getsize(path) - 10)
    assert main(["verify", ckpt]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM (file): data file {name} is truncated" in out and "FAILED: 1 problem(s)" in out

    os.unlink(path)
    report = verify_checkpoint(ckpt)
    assert [p.message.split(" (")[0] for p in report.problems] == [f"data file {name} is missing"]


def test_verify_finds_tensors_the_shards_do_not_cover(ckpt):
    # Forge generation 2: the same data, but a manifest that lost one of a tensor's two shards.
    checkpoint = open_checkpoint(ckpt)
    manifest, entry = checkpoint.manifest, checkpoint.tensors["model/embed.weight"]
    manifest.tensors[entry.name] = TensorEntry(entry.name, entry.dtype, entry.shape, entry.shards[:1])
    manifest.generation = 2
    assert checkpoint.location.claim_next_generation() == 2  # a writer claims its generation first
    shutil.copytree(os.path.join(ckpt, "gen-00000001", "data"), os.path.join(ckpt, "gen-00000002", "data"))
    checkpoint.location.commit(2, manifest)

    report = verify_checkpoint(ckpt)
    assert report.generation == 2
    [problem] = report.problems
    assert problem.entry == "model/embed.weight"
    assert problem.message.startswith("the saved shards do not cover the tensor exactly") and "held by no shard" in \
        problem.message


def test_unreadable_checkpoints_fail_with_a_clear_message(ckpt, tmp_path, capsys):
    with open(os.path.join(ckpt, "gen-00000001", "manifest.json"), "ab") as f:
        f.write(b" ")
    for command in ("inspect", "verify"):
        assert main([command, ckpt]) == 1
        assert "manifest does not match the checksum in the commit marker" in capsys.readouterr().err
        assert main([command, str(tmp_path / "nowhere")]) == 1
        assert "no such checkpoint path" in capsys.readouterr().err
    os.makedirs(tmp_path / "dcp")
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    assert main(["inspect", str(tmp_path / "dcp")]) == 1
    assert "looks like a PyTorch DCP checkpoint" in capsys.readouterr().err


def test_progress_is_drawn_on_a_terminal_only(ckpt):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert not isinstance(progress_for(io.StringIO()), TerminalProgress)  # a pipe or a log: nothing
    assert not isinstance(progress_for(Terminal(), quiet=True), TerminalProgress)  # --quiet
    screen = Terminal()
    progress = progress_for(screen)
    assert isinstance(progress, TerminalProgress)
    verify_checkpoint(ckpt, progress=progress)
    drawn = screen.getvalue()
    assert drawn.startswith("\rverify:") and "B/s" in drawn and "<" in drawn  # done of total, speed, time left
    assert drawn.rstrip(" ").endswith("\r")  # erased when done: the cursor is back at an emptied line


def test_summary_of_a_generation_in_progress(ckpt):
    os.makedirs(os.path.join(ckpt, "gen-00000002", "data"))  # a save that is running or died
    summary = summarize(open_checkpoint(ckpt))
    assert summary["generation"] == 1
    assert summary["generations"] == [{"generation": 1, "committed": True, "created": summary["created"], "step": None},
                                      {"generation": 2, "committed": False, "created": None, "step": None}]
