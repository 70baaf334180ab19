"""Per-rank values: identical ones are stored once; across a change of world size each case follows
one rule, and a load that duplicates or drops a value says so (``LoadResult`` and a WARNING)."""

from __future__ import annotations

import logging

import bcp
from models import build, rank, read_manifest, train


def save_values(path: str) -> None:
    model, optimizer = build("ddp", seed=1)
    train(model, optimizer, range(1))
    bcp.save(path, {"model": model, "optimizer": optimizer, "extra_state": {"step": 1}, "seen": [rank(), 10 * rank()]})


def test_identical_values_are_stored_once_differing_ones_per_rank(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_values, path)
    objects = read_manifest(path).objects
    for name in ("extra_state", "optimizer/param_groups"):
        assert len(objects[name].records) == 1 and objects[name].ranks == [0, 0], name
    assert len(objects["seen"].records) == 2


def test_a_load_on_fewer_ranks_warns_about_the_values_it_drops(ranks, tmp_path, caplog):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_values, path)
    model, optimizer = build("plain", seed=2)
    state = {"model": model, "optimizer": optimizer, "extra_state": None, "seen": None}
    with caplog.at_level(logging.WARNING, logger="bcp"):
        result = bcp.load(path, state)
    assert state["seen"] == [0, 0] and state["extra_state"] == {"step": 1}
    assert result.dropped == {"seen": [1]} and result.duplicated == {}
    assert "seen (ranks [1])" in caplog.text and "extra_state" not in caplog.text


def load_values(path: str) -> list:
    state = {"seen": None}
    result = bcp.load(path, state)
    return [state["seen"], result.duplicated, result.from_rank0]


def test_a_load_on_more_ranks_reports_the_values_it_duplicates(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    bcp.save(path, {"seen": [7]})
    assert ranks(2).run(load_values, path) == [[[7], {"seen": [1]}, []], [[7], {"seen": [1]}, ["seen"]]]
