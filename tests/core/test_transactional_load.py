"""A load that fails (a damaged byte found by its checksum) leaves the live state exactly as it was,
so a training loop can catch the error and go on; ``transactional=False`` trades that for one copy
less, and then the error is all that protects the caller.

Guards a past defect: a load that failed its checksum left the corrupted bytes (or a mix of old and
new) in the live tensors."""

from __future__ import annotations

import pytest
import torch

import bcp


def _damaged_checkpoint(tmp_path):
    saved = {"a": torch.arange(4096.0), "b": torch.arange(4096.0) * 2}
    bcp.save(tmp_path, {"model": saved})
    data = sorted(tmp_path.glob("gen-*/data/*.bin"))[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 + 3] ^= 0xFF  # one byte in the middle of the data file
    data.write_bytes(bytes(raw))
    return saved


def test_a_failed_load_leaves_every_live_tensor_as_it_was(tmp_path):
    _damaged_checkpoint(tmp_path)
    live = {"a": torch.full((4096,), -1.0), "b": torch.full((4096,), -2.0)}
    before = {k: v.clone() for k, v in live.items()}
    with pytest.raises(bcp.CorruptCheckpointError, match="checksum mismatch"):
        bcp.load(tmp_path, {"model": live})
    assert all(torch.equal(live[k], before[k]) for k in live)  # neither the damaged nor the good tensor moved


def test_without_transactions_the_live_state_may_be_partly_overwritten(tmp_path):
    _damaged_checkpoint(tmp_path)
    live = {"a": torch.full((4096,), -1.0), "b": torch.full((4096,), -2.0)}
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.load(tmp_path, {"model": live}, transactional=False)
    assert not (torch.all(live["a"] == -1) and torch.all(live["b"] == -2))
