"""bcp pauses Python's cyclic garbage collector while it builds per-tensor records; the user's
setting must be back once save returns or raises."""

from __future__ import annotations

import gc

import pytest
import torch

import bcp


def test_save_restores_an_enabled_collector_after_success_and_failure(tmp_path):
    assert gc.isenabled()
    bcp.save(tmp_path / "ok", {"model": {"w": torch.ones(3)}})
    assert gc.isenabled()
    with pytest.raises(bcp.CheckpointError):
        bcp.save(tmp_path / "bad", {"model": {"w": torch.ones(3).to_sparse()}})
    assert gc.isenabled()


def test_save_leaves_a_disabled_collector_disabled(tmp_path):
    gc.disable()
    try:
        bcp.save(tmp_path / "ok", {"model": {"w": torch.ones(3)}})
        assert not gc.isenabled()
    finally:
        gc.enable()
