"""The memory tier on real gloo ranks: 4 ranks simulated as 2 nodes of 2 (``nodes=``), each node
with a folder of its own; a lost node is its folder deleted. Recovery reads no byte of the
persistent checkpoint (a storage that counts its reads says so), in the same and in a smaller
layout, optimizer included; both copies of a shard lost falls back to the persistent checkpoint,
naming what is missing; and every k-th save is an ordinary checkpoint at the persistent path."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import bcp
from bcp.storage import LocalStorage
from bcp.tier import memory_tier
from bcp.tier.placement import Placement
from models import assert_bitwise, build, full_state, rank, train

NODES = ["a", "a", "b", "b"]


class CountingStorage(LocalStorage):
    """A local folder that counts the reads made of it."""

    reads = 0

    def read_into_many(self, name, offset, dests):
        CountingStorage.reads += 1
        super().read_into_many(name, offset, dests)

    def read_bytes(self, name):
        CountingStorage.reads += 1
        return super().read_bytes(name)


def _tier(root: str, nodes: list[str], persist_every: int = 100) -> bcp.MemoryTier:
    return bcp.MemoryTier(CountingStorage(os.path.join(root, "persistent")), local_dir=os.path.join(root, "tier"),
                          nodes=nodes, persist_every=persist_every)


def train_and_save(root: str, kind: str, saves: int, persist_every: int, async_save: bool) -> list[dict]:
    """Train, saving to the tier after each step; every rank returns the whole state at each save."""
    model, optimizer = build(kind, seed=0)
    states = []
    for step in range(saves):
        train(model, optimizer, range(step, step + 1))
        handle = bcp.save(_tier(root, NODES, persist_every), {"model": model, "optimizer": optimizer,
                                                              "extra_state": {"step": step}}, async_save=async_save)
        states.append(full_state(model, optimizer))  # bcp staged its copy: the next step cannot change it
        if step == saves - 1:
            handle.wait()
    return states


def load_tier(root: str, kind: str, nodes: list[str]) -> tuple:
    """A fresh model loads from the tier; its whole state, where it came from, and the persistent
    storage's reads."""
    model, optimizer = build(kind, seed=7)
    train(model, optimizer, range(50, 51))  # different values everywhere, optimizer state included
    CountingStorage.reads = 0
    state = {"model": model, "optimizer": optimizer, "extra_state": {"step": -1}}
    result = bcp.load(_tier(root, nodes), state)
    return (full_state(model, optimizer), state["extra_state"]["step"], result.source, result.source_reason,
            CountingStorage.reads, result.stats.received_bytes)


def load_path(path: str, kind: str) -> tuple:
    model, optimizer = build(kind, seed=7)
    train(model, optimizer, range(50, 51))
    state = {"model": model, "optimizer": optimizer, "extra_state": {"step": -1}}
    bcp.load(path, state)
    return full_state(model, optimizer), state["extra_state"]["step"]


def _lose_node(root: Path, node: str) -> None:
    shutil.rmtree(root / "tier" / f"node-{node}")


@pytest.mark.parametrize("lost", ["b", "a"])  # node a holds rank 0, which coordinates the load
def test_a_replaced_node_recovers_bitwise_from_its_peers_without_reading_storage(ranks, tmp_path, lost):
    saved = ranks(4).run(train_and_save, str(tmp_path), "fsdp2", 1, 100, False)
    _lose_node(tmp_path, lost)
    loaded = ranks(4).run(load_tier, str(tmp_path), "fsdp2", NODES)
    for rank_, (state, step, source, reason, reads, fetched) in enumerate(loaded):
        assert_bitwise(saved[0][0], state)
        assert step == 0 and source == "memory", reason
        assert reads == 0, f"rank {rank_} read the persistent storage {reads} times"
        assert (fetched > 0) == (NODES[rank_] == lost), (rank_, fetched)  # the replaced node's ranks fetched


def test_the_survivors_recover_into_a_smaller_layout_from_their_own_tier(ranks, tmp_path):
    saved = ranks(4).run(train_and_save, str(tmp_path), "fsdp2", 1, 100, False)
    _lose_node(tmp_path, "b")
    loaded = ranks(2).run(load_tier, str(tmp_path), "fsdp2", ["a", "a"])
    for state, step, source, reason, reads, fetched in loaded:
        assert_bitwise(saved[0][0], state)  # FSDP2 over 4 ranks -> over 2, AdamW state included
        assert step == 0 and source == "memory" and reads == 0 and fetched == 0, reason


def test_both_copies_of_a_shard_lost_fall_back_to_the_persistent_checkpoint(ranks, tmp_path):
    saved = ranks(4).run(train_and_save, str(tmp_path), "fsdp2", 1, 1, False)  # persisted at once
    _lose_node(tmp_path, "b")
    for copy in (tmp_path / "tier" / "node-a").glob("gen-*/data/00002-*.bin"):  # rank 2's copy on node a
        copy.unlink()
    loaded = ranks(4).run(load_tier, str(tmp_path), "fsdp2", NODES)
    for state, step, source, reason, reads, _ in loaded:
        assert_bitwise(saved[0][0], state)
        assert source == "persistent" and reads > 0
        assert "data/00002-00.bin" in reason and "rank 2" in reason and "persistent checkpoint" in reason, reason


def test_nothing_to_load_is_a_clear_error(ranks, tmp_path):
    ranks(4).run(train_and_save, str(tmp_path), "plain", 1, 100, False)  # never persisted
    _lose_node(tmp_path, "b")
    for copy in (tmp_path / "tier" / "node-a").glob("gen-*/data/00003-*.bin"):
        copy.unlink()
    with pytest.raises(AssertionError, match="CheckpointNotFoundError: nothing to load: generation 1 lacks "
                                             r"data/00003-00.bin \(the shards saved by rank 3\)"):
        ranks(4).run(load_tier, str(tmp_path), "plain", NODES)


def test_every_kth_save_is_an_ordinary_checkpoint_at_the_persistent_path(ranks, tmp_path):
    saved = ranks(4).run(train_and_save, str(tmp_path), "fsdp2", 5, 2, True)  # async: persisted in the background
    committed = sorted(p.parent.name for p in (tmp_path / "persistent").glob("gen-*/COMMITTED"))
    assert committed == ["gen-00000001", "gen-00000002"], committed  # saves 2 and 4, keep_generations=2
    for state, step in ranks(4).run(load_path, str(tmp_path / "persistent"), "fsdp2"):
        assert_bitwise(saved[0][3], state)
        assert step == 3
    for state, step, source, reason, reads, _ in ranks(2).run(load_tier, str(tmp_path), "fsdp2", ["a", "b"]):
        assert_bitwise(saved[0][4], state)  # the tier holds the newest save (2 ranks, one per node)
        assert step == 4 and source == "memory" and reads == 0, reason


@pytest.mark.parametrize("nodes,replicas", [(["a", "a", "b", "b"], 1), (["a", "b", "c", "a", "b"], 2),
                                            (["a", "a", "a", "b", "c", "c"], 1)])
def test_no_rank_copies_its_files_to_its_own_node(nodes, replicas):
    placement = Placement.of(nodes, replicas)
    for sender in range(len(nodes)):
        receivers = placement.receivers(sender)
        assert len({nodes[r] for r in receivers}) == replicas and nodes[sender] not in {nodes[r] for r in receivers}
        assert all(sender in placement.senders(r) for r in receivers)


def test_more_copies_than_other_nodes_are_capped():
    assert Placement.of(["a", "a", "b"], 3).replicas == 1
    assert Placement.of(["a", "a"], 1).receivers(0) == []


def test_a_machine_without_dev_shm_asks_for_a_local_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(memory_tier, "SHM", str(tmp_path / "no-shm"))
    with pytest.raises(bcp.CheckpointError, match="does not exist on this machine: pass MemoryTier\\(local_dir=...\\)"):
        bcp.save(bcp.MemoryTier(), {"model": {"w": torch.zeros(2)}})


def test_bad_arguments_are_refused():
    with pytest.raises(bcp.CheckpointError, match="persist_every"):
        bcp.MemoryTier(persist_every=0)
    with pytest.raises(bcp.CheckpointError, match="replicas"):
        bcp.MemoryTier(replicas=-1)
    with pytest.raises(bcp.CheckpointError, match="one per rank"):
        bcp.save(bcp.MemoryTier(local_dir="unused", nodes=["a", "b"]), {"model": {"w": torch.zeros(2)}})
