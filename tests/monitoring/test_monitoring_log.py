"""The metrics log beside the checkpoints, on by default: ``bcp report`` reads it from a plain
checkpoint path or URL, retention, listing and ``bcp verify`` never take it for checkpoint data, a
load from a read-only folder skips it quietly, and concurrent loaders never lose or mix records."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import uuid
from typing import Iterator

import pytest
import torch

import bcp
from bcp.api.metrics_log import read_records
from bcp.cli import main
from bcp.engine.location import METRICS_DIR
from bcp.tools import report
from models import rank

STATE = {"model": {"w": torch.arange(64, dtype=torch.float32)}}


def fresh() -> dict:
    return {"model": {"w": torch.zeros(64)}}


def test_bcp_report_reads_the_log_of_a_plain_save_with_no_option_set(tmp_path, capsys):
    bcp.save(tmp_path, STATE)
    assert main(["report", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["op"], summary["path"], summary["generation"], summary["ok"]) == ("save", str(tmp_path), 1, True)
    assert summary["bytes"] == 256 and {p["phase"] for p in summary["phases"]} >= {"collect", "write", "commit"}
    assert main(["report", str(tmp_path)]) == 0
    assert f"bcp save {tmp_path} generation 1: ok" in capsys.readouterr().out


def test_retention_listing_and_verify_leave_the_log_alone(tmp_path, capsys):
    for _ in range(3):
        bcp.save(tmp_path, STATE, keep_generations=1)
    bcp.load(tmp_path, fresh())
    assert sorted(os.listdir(tmp_path)) == [METRICS_DIR, "gen-00000003"]  # retention removed gen 1 and 2 only
    assert [(r["op"], r["generation"]) for r in read_records(tmp_path)] == [
        ("save", 3), ("load", 3)]  # in the order they ran; those of removed generations go with them
    assert main(["verify", str(tmp_path)]) == 0 and "OK" in capsys.readouterr().out
    assert bcp.load(tmp_path, fresh()).generation == 3


def test_report_reads_the_log_on_an_object_store_url():
    url = f"memory://{uuid.uuid4().hex[:8]}/ckpt"
    bcp.save(url, STATE)
    bcp.load(url, fresh())
    assert [r["op"] for r in read_records(url)] == ["save", "load"]
    summary = report(url, op="save")
    assert summary.record.ok and summary.record.path == url and summary.record.bytes == 256


def test_a_role_may_not_be_named_as_the_log_folder(tmp_path):
    with pytest.raises(bcp.CheckpointError, match="invalid role"):
        bcp.save(tmp_path, STATE, role=METRICS_DIR)


@contextlib.contextmanager
def read_only(folder: str) -> Iterator[None]:
    """``folder``'s tree made read-only for real: write permission removed, and for root (whom
    permissions do not stop) the immutable attribute of ext4/xfs; skipped where neither holds."""
    subprocess.run(["chmod", "-R", "a-w", folder], check=True)
    immutable = os.geteuid() == 0 and shutil.which("chattr") is not None and \
        subprocess.run(["chattr", "-R", "+i", folder], capture_output=True).returncode == 0
    try:
        probe = os.path.join(folder, "probe")
        try:
            open(probe, "w").close()
        except OSError:
            yield
            return
        os.unlink(probe)
        pytest.skip("cannot make a folder read-only here (root without chattr on this file system)")
    finally:
        if immutable:
            subprocess.run(["chattr", "-R", "-i", folder], check=True)
        subprocess.run(["chmod", "-R", "u+w", folder], check=True)


def test_a_load_from_a_read_only_folder_skips_the_log_with_one_debug_message(tmp_path, caplog):
    path = str(tmp_path / "ckpt")
    bcp.save(path, STATE)
    with read_only(path), caplog.at_level(logging.DEBUG, logger="bcp"):
        result = bcp.load(path, fresh())
    assert result.metrics.ok and result.generation == 1  # the record is still on the result
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    skipped = [r.getMessage() for r in caplog.records if "no metrics log" in r.getMessage()]
    assert len(skipped) == 1 and path in skipped[0]
    assert [r["op"] for r in read_records(path)] == ["save"]


def test_a_save_that_cannot_write_its_log_warns_but_succeeds(tmp_path, caplog):
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    open(os.path.join(path, METRICS_DIR), "w").close()  # a file where the log's folder would go
    with caplog.at_level(logging.WARNING, logger="bcp"):
        handle = bcp.save(path, STATE)
    assert handle.generation == 1 and handle.metrics.ok
    assert any("could not write the metrics log" in r.getMessage() for r in caplog.records)


LOADS = 6


def load_many(path: str, log_file: str) -> int:
    """Each rank loads alone (its own single-process coordinator), all ranks at once: concurrent
    loaders of one checkpoint, writing to the log beside it and to one named file."""
    for i in range(LOADS):
        target = True if i % 2 == 0 else log_file
        bcp.load(path, fresh(), coordinator=bcp.SingleProcessCoordinator(), metrics_log=target)
    return rank()


def test_concurrent_loaders_never_lose_or_mix_records(ranks, tmp_path):
    path, log_file = str(tmp_path / "ckpt"), str(tmp_path / "shared.jsonl")
    bcp.save(path, STATE)
    assert ranks(2).run(load_many, path, log_file) == [0, 1]
    beside = list(read_records(path))
    assert [r["op"] for r in beside] == ["save"] + ["load"] * LOADS  # 3 per rank, each whole
    with open(log_file) as lines:
        named = [json.loads(line) for line in lines]  # every line parses: no interleaving
    assert len(named) == LOADS and all(r["op"] == "load" and r["ok"] for r in named)
    assert sorted(os.listdir(path)) == [METRICS_DIR, "gen-00000001"]


def test_the_log_keeps_the_history_of_the_generations_kept(tmp_path):
    """The log used to grow by one object per operation forever; it now follows the checkpoint's
    retention: records of operations older than the oldest generation kept are removed."""
    path = tmp_path / "ckpt"
    for _ in range(6):
        bcp.save(path, STATE, keep_generations=2)
        bcp.load(path, fresh())
    records = list(read_records(path))
    assert [(r["op"], r["generation"]) for r in records] == [("save", 5), ("load", 5), ("save", 6), ("load", 6)]
    assert len(os.listdir(path / METRICS_DIR)) == 4
