"""The metrics log on s3:// against a real SeaweedFS server: an object per operation beside the
checkpoints (S3 cannot append), read back in order by ``bcp report`` from the URL; a load with
read-only access (403 on every write, from a loopback proxy) succeeds with one DEBUG message."""

from __future__ import annotations

import json
import logging

import bcp
import torch
from bcp.api.metrics_log import read_records
from bcp.cli import main
from bcp.storage import S3Storage
from s3_fault_proxy import FaultProxy

STATE = {"model": {"w": torch.arange(64, dtype=torch.float32)}}


def fresh() -> dict:
    return {"model": {"w": torch.zeros(64)}}


def only_reads(method: str, path: str) -> str | None:
    return "forbidden" if method in ("PUT", "POST", "DELETE") else None


def test_the_log_beside_an_s3_checkpoint_and_a_load_that_may_only_read(s3_server, s3_url, s3_env, capsys, caplog):
    bcp.save(s3_url, STATE)
    bcp.save(s3_url, STATE)
    proxy, loaded = FaultProxy(s3_server.endpoint, fault=only_reads), fresh()
    try:
        with caplog.at_level(logging.DEBUG, logger="bcp"):
            result = bcp.load(S3Storage(s3_url, **s3_server.options(proxy.endpoint)), loaded)
    finally:
        proxy.close()
    assert result.generation == 2 and result.metrics.ok and torch.equal(loaded["model"]["w"], STATE["model"]["w"])
    assert proxy.faults["forbidden"] == 1  # the log's one write was refused, and nothing else was tried
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([r for r in caplog.records if "no metrics log" in r.getMessage()]) == 1
    bcp.load(s3_url, fresh())
    assert [(r["op"], r["generation"]) for r in read_records(s3_url)] == [("save", 1), ("save", 2), ("load", 2)]
    assert main(["report", s3_url, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["op"], summary["path"], summary["ok"], summary["bytes"]) == ("load", s3_url, True, 256)
