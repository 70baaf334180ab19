"""A failure on one rank is reported on every rank within a bounded time, and never leaves a
checkpoint that loads as valid."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import bcp
from bcp.engine.location import METRICS_DIR
from bcp.storage import LocalStorage


class FailingOnRank1(LocalStorage):
    """Fault injection: a disk write error on rank 1 cannot be produced for real on this machine
    (we run as root on one healthy disk), so rank 1's storage raises where a write would fail."""

    def write_file(self, name, chunks):
        if dist.get_rank() == 1 and "/data/" in name:
            raise OSError(28, "No space left on device")
        super().write_file(name, chunks)


def outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except bcp.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"


def write_failure(path: str) -> list:
    state = {"model": {"w": torch.full((64,), 1.0)}}
    bcp.save(path, state)
    state = {"model": {"w": torch.full((64,), 2.0), "u": torch.ones(64)}}
    failed = outcome(lambda: bcp.save(FailingOnRank1(path), state))
    out = {"w": torch.zeros(64)}
    bcp.load(path, {"model": out})
    return [failed, out["w"][0].item(), sorted(os.listdir(path))]


def test_write_failure_on_one_rank_fails_everywhere_and_keeps_last_checkpoint(ranks, tmp_path):
    results = ranks(2).run(write_failure, str(tmp_path))
    assert results[0][0].startswith("StorageError") and "rank 1" in results[0][0]
    for failed, value, listing in results:
        assert "No space left on device" in failed
        assert value == 1.0  # the last good checkpoint is the one that loads
        assert listing[:2] == [METRICS_DIR, "gen-00000001"]  # the last good generation is kept


def planning_failure(path: str) -> str:
    extra = {"x": object()} if dist.get_rank() == 1 else {"x": 1}
    return outcome(lambda: bcp.save(path, {"model": {"w": torch.ones(2)}, "extra_state": extra}))


def test_bad_value_on_one_rank_is_reported_on_all(ranks, tmp_path):
    messages = ranks(2).run(planning_failure, str(tmp_path))
    assert all(m.startswith("UnsupportedValueError") and "'extra_state'" in m for m in messages)
    assert "rank 1" in messages[0]
    assert not any(p.startswith("gen-") and os.path.exists(tmp_path / p / "COMMITTED") for p in os.listdir(tmp_path))


def different_targets(path: str) -> list:
    state = {"model": {"w": torch.ones(4)}}
    bcp.save(path, state)  # one good checkpoint first: the refused save must leave it the latest
    mine = os.path.join(path, "elsewhere") if dist.get_rank() == 1 else path
    refused = outcome(lambda: bcp.save(mine, {"model": {"w": torch.zeros(4)}}))
    out = {"w": torch.full((4,), 7.0)}
    loaded = bcp.load(path, {"model": out})
    return [refused, out["w"].tolist(), loaded.generation]


def test_ranks_naming_different_checkpoints_are_refused_before_writing(ranks, tmp_path):
    results = ranks(2).run(different_targets, str(tmp_path))
    for refused, loaded, generation in results:
        assert refused.startswith("CheckpointError") and "different checkpoints" in refused
        assert f"ranks [0]: {tmp_path}/" in refused and f"ranks [1]: {tmp_path}/elsewhere/" in refused
        assert loaded == [1.0] * 4 and generation == 1
    assert not os.path.exists(tmp_path / "elsewhere" / "gen-00000001")


def load_mismatch(path: str) -> str:
    bcp.save(path, {"model": {"w": torch.ones(4, 4)}})
    shape = (4, 4) if dist.get_rank() == 0 else (4, 5)
    return outcome(lambda: bcp.load(path, {"model": {"w": torch.zeros(shape)}}))


def test_load_failure_on_one_rank_is_raised_on_every_rank(ranks, tmp_path):
    messages = ranks(2).run(load_mismatch, str(tmp_path))
    assert all(m.startswith("MismatchError") and "'model/w'" in m for m in messages)
    assert "rank 1" in messages[0]


def absent_rank(path: str) -> str:
    coordinator = bcp.TorchCoordinator(timeout=3.25)  # a group of its own: it is left unusable after the timeout
    if dist.get_rank() == 1:
        return "did not call save"
    return outcome(lambda: bcp.save(path, {"model": {"w": torch.ones(2)}}, coordinator=coordinator))


def test_rank_that_never_joins_fails_the_others_within_the_timeout(ranks, tmp_path):
    messages = ranks(2).run(absent_rank, str(tmp_path))
    assert messages[0].startswith("DistributedError") and "did not call bcp" in messages[0]


def value_saved_by_rank1_only(path: str) -> list:
    state = {"model": {"w": torch.ones(2)}}
    if dist.get_rank() == 1:
        state["extra_state"] = {"only": "rank 1"}
    bcp.save(path, state)
    out = {"model": {"w": torch.zeros(2)}, "extra_state": None}
    result = bcp.load(path, out)
    return [out["extra_state"], result.from_rank0]


def test_value_saved_by_one_rank_only_is_given_to_the_others(ranks, tmp_path):
    assert ranks(2).run(value_saved_by_rank1_only, str(tmp_path)) == [
        [{"only": "rank 1"}, ["extra_state"]], [{"only": "rank 1"}, []]]
