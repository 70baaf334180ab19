"""Checkpoints through the HDFS backend's code, over pyarrow's local file system (no Hadoop here):
saved twice, loaded bitwise, the commit markers written as claimed directories."""

from __future__ import annotations

import torch
from pyarrow.fs import LocalFileSystem

import bcp
from bcp.engine.location import METRICS_DIR
from bcp.storage import HdfsStorage, registered_schemes
from bcp.storage.hdfs import PAYLOAD
from models import assert_bitwise


def test_save_and_load_through_the_hdfs_backend(tmp_path):
    storage = HdfsStorage(f"hdfs://stand-in{tmp_path}/run", filesystem=LocalFileSystem())
    first = {"model": {"w": torch.randn(64, 32), "b": torch.arange(7)}}
    second = {"model": {"w": torch.randn(64, 32), "b": torch.arange(7) * 2}}
    bcp.save(storage, first)
    bcp.save(storage, second)
    loaded = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(7, dtype=torch.int64)}}
    bcp.load(storage, loaded)
    assert_bitwise(second["model"], loaded["model"])
    assert (tmp_path / "run" / "gen-00000002" / "COMMITTED" / PAYLOAD).is_file()
    assert storage.list_dir("") == [METRICS_DIR, "gen-00000001", "gen-00000002"]
    assert len(storage.list_dir(METRICS_DIR)) == 3  # two saves and a load, one object each (no append)
    assert "hdfs" in registered_schemes()  # hdfs:// URLs open HdfsStorage on pyarrow's HadoopFileSystem
