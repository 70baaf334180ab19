"""Megatron-Core's ``remove_sharded_tensors`` on a bcp checkpoint, on 2 gloo ranks with real
Megatron-Core objects: the state of Megatron-Core's own ``test_remove_sharded_tensors``
(tests/unit_tests/dist_checkpointing/test_serialization.py at core_v0.16.1: ``keyA`` and
``prefix_key_to_remove``, pruned with ``key_prefix="prefix"`` on rank 0 alone) plus a ShardedObject
kept and one removed, saved through ``dist_checkpointing.save`` with ``('bcp', 1)``.

After the pruning every rank sees only the kept keys, loads them bitwise, and fails with Megatron's
exception on a removed one; the removed tensor's and object's bytes are in no stored file any more;
``bcp verify`` passes. An interrupted pruning (the one mock here: a fault injected just before or
just after the new generation's commit, a crash that cannot be produced for real in a test) leaves a
loadable checkpoint, the old one or the pruned one."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import bcp_megatron  # noqa: F401  (registers the ('bcp', 1) backend)
from bcp.cli import main
from bcp.engine.location import Location
from bcp.tools import verify_checkpoint
from megatron_parts import parallel, raised

REMOVED_OBJECT = "removed-object-7f3c"


def _state(rank: int, world: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    removed = torch.arange(105, dtype=torch.float64).reshape(3, 5, 7) * 1.0001 + 1000 * rank + 0.5
    return {
        "sd_keyA": ShardedTensor.from_rank_offsets("keyA", torch.arange(8.0).reshape(2, 4) + 10 * rank,
                                                   (0, rank, world)),
        "sd_prefix_key_to_remove": ShardedTensor.from_rank_offsets("prefix_key_to_remove", removed, (2, rank, world)),
        "kept_object": ShardedObject("objB", {"step": 3 + rank}, (world,), (rank,), replica_id=0),
        "removed_object": ShardedObject("prefix_obj", f"{REMOVED_OBJECT}-{rank}", (world,), (rank,), replica_id=0),
    }


def _stored(path: str) -> bytes:
    """Every byte bcp stores for the checkpoint: all files of its generations, concatenated."""
    files = sorted(p for p in Path(path).rglob("*") if p.is_file() and p.relative_to(path).parts[0].startswith("gen-"))
    return b"".join(p.read_bytes() for p in files)


def _generations(path: str) -> list[tuple[str, bool]]:
    return sorted((p.name, (p / "COMMITTED").exists()) for p in Path(path).glob("gen-*"))


def _loaded(path: str, rank: int, world: int) -> dict:
    """What this rank sees in the checkpoint: metadata keys, the kept values, and each removed key's load."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, load, load_tensors_metadata
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    saved = _state(rank, world)
    fresh = {"a": ShardedTensor.from_rank_offsets("keyA", torch.full((2, 4), -7.0), (0, rank, world)),
             "b": ShardedObject("objB", None, (world,), (rank,), replica_id=0)}
    loaded = load(fresh, path)
    return {
        "tensor keys": sorted(load_tensors_metadata(path)),
        "sharded keys": sorted(load_sharded_metadata(path)),
        "keyA": torch.equal(loaded["a"], saved["sd_keyA"].data) and loaded["a"].dtype == torch.float32,
        "objB": loaded["b"],
        "removed tensor": raised(lambda: load({"x": saved["sd_prefix_key_to_remove"]}, path)),
        "removed object": raised(lambda: load({"x": saved["removed_object"]}, path)),
        "verify": verify_checkpoint(path).ok,
    }


def save_and_remove(path: str) -> dict:
    from megatron.core.dist_checkpointing import remove_sharded_tensors, save

    rank, world = dist.get_rank(), dist.get_world_size()
    with parallel():
        state = _state(rank, world)
        save(state, path, sharded_strategy=("bcp", 1))
        patterns = {"removed tensor": state["sd_prefix_key_to_remove"].data.numpy().tobytes(),
                    "removed object": f"{REMOVED_OBJECT}-{rank}".encode(),
                    "keyA": state["sd_keyA"].data.numpy().tobytes()}
        dist.barrier()
        stored = _stored(path)
        found_before = {name: pattern in stored for name, pattern in patterns.items()}
        generations_before = _generations(path)
        dist.barrier()
        no_match = []
        if rank == 0:  # as Megatron-LM calls it: one rank, the others wait (a collective here would hang)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                remove_sharded_tensors(path, key_prefix="nothing")
            no_match = [str(w.message) for w in caught]
            unchanged = _generations(path) == generations_before
            remove_sharded_tensors(path, key_prefix="prefix")
        dist.barrier()
        stored_after = _stored(path)
        outcome = _loaded(path, rank, world)
        outcome.update(found_before=found_before, found_after={n: p in stored_after for n, p in patterns.items()},
                       bytes_before=len(stored), bytes_after=len(stored_after),
                       generations_before=generations_before, generations_after=_generations(path),
                       no_match=no_match, unchanged_without_match=rank != 0 or unchanged)
        dist.barrier()
    return outcome


def test_remove_sharded_tensors_drops_keys_and_their_bytes(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    outcomes = ranks(2).run(save_and_remove, path)
    for rank, outcome in enumerate(outcomes):
        # the bytes were there, and only the removed entries' are gone
        assert outcome["found_before"] == {"removed tensor": True, "removed object": True, "keyA": True}
        assert outcome["found_after"] == {"removed tensor": False, "removed object": False, "keyA": True}
        assert outcome["bytes_before"] - outcome["bytes_after"] >= 2 * 105 * 8  # both ranks' shards of the tensor
        assert outcome["generations_before"] == [("gen-00000001", True)]
        assert outcome["generations_after"] == [("gen-00000002", True)]  # the old generation is removed
        # what is kept loads as saved; what is removed is gone from the metadata and fails to load
        assert outcome["tensor keys"] == ["keyA"]
        assert outcome["sharded keys"] == ["keyA", "objB/shard_0_2", "objB/shard_1_2"]
        assert outcome["keyA"] is True and outcome["objB"] == {"step": 3 + rank}
        for key, removed in (("removed tensor", "prefix_key_to_remove"),
                             ("removed object", f"prefix_obj/shard_{rank}_2")):
            is_megatron, bcp_class, message = outcome[key]
            assert (is_megatron, bcp_class) == (True, "MismatchError"), outcome[key]
            assert removed in message and path in message
        assert outcome["verify"] is True
        assert outcome["unchanged_without_match"] is True
    # a prefix that matches nothing warns naming the checkpoint and changes nothing, as torch_dist's
    assert len(outcomes[0]["no_match"]) == 1 and path in outcomes[0]["no_match"][0]
    assert "'nothing'" in outcomes[0]["no_match"][0]
    assert main(["verify", path]) == 0


def interrupted_removal(path: str, fault: str) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor, load, remove_sharded_tensors, save

    rank, world = dist.get_rank(), dist.get_world_size()
    with parallel():
        state = _state(rank, world)
        save(state, path, sharded_strategy=("bcp", 1))
        dist.barrier()
        error = None
        if rank == 0:
            # The one mock: a crash of the pruning process just before its commit marker is written,
            # or just after, before the old generation is removed.
            target = "commit" if fault == "before commit" else "apply_retention"
            with mock.patch.object(Location, target, side_effect=OSError(f"injected crash {fault}")):
                error = raised(lambda: remove_sharded_tensors(path, key_prefix="prefix"))
        dist.barrier()
        removed = ShardedTensor.from_rank_offsets("prefix_key_to_remove", torch.zeros(3, 5, 7, dtype=torch.float64),
                                                  (2, rank, world))
        outcome = _loaded(path, rank, world)
        outcome.update(raised=error, generations=_generations(path))
        if fault == "before commit":  # the old generation is still the checkpoint, the tensor with it
            outcome["removed tensor loads"] = torch.equal(load({"x": removed}, path)["x"],
                                                          state["sd_prefix_key_to_remove"].data)
        dist.barrier()
    return outcome


@pytest.mark.parametrize("fault", ["before commit", "after commit"])
def test_interrupted_removal_leaves_a_loadable_checkpoint(ranks, tmp_path, fault):
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    outcomes = ranks(2).run(interrupted_removal, path, fault)
    is_megatron, bcp_class, message = outcomes[0]["raised"]
    assert is_megatron is True and bcp_class is not None and f"injected crash {fault}" in message, outcomes[0]["raised"]
    for rank, outcome in enumerate(outcomes):
        assert outcome["keyA"] is True and outcome["objB"] == {"step": 3 + rank} and outcome["verify"] is True
        if fault == "before commit":
            assert outcome["generations"] == [("gen-00000001", True)]  # the failed generation removed whole
            assert outcome["tensor keys"] == ["keyA", "prefix_key_to_remove"]
            assert outcome["removed tensor loads"] is True
        else:
            assert outcome["generations"] == [("gen-00000001", True), ("gen-00000002", True)]
            assert outcome["tensor keys"] == ["keyA"]
            assert outcome["removed tensor"][:2] == (True, "MismatchError")
    assert main(["verify", path]) == 0


def remove_through_url(path: str, torch_dist_named: bool) -> list[str]:
    """The strategy called directly: bcp's, with the checkpoint as a ``file://`` URL (any storage bcp
    reads), or the one standing in for torch_dist's by name (Megatron-LM 0.17), with the folder."""
    from megatron.core.dist_checkpointing import load_tensors_metadata, save

    from bcp_megatron.strategies_torch_dist import BcpLoadShardedStrategy as TorchDistNamed

    rank, world = dist.get_rank(), dist.get_world_size()
    with parallel():
        save(_state(rank, world), path, sharded_strategy=("bcp", 1))
        dist.barrier()
        if rank == 0 and torch_dist_named:
            TorchDistNamed().remove_sharded_tensors(path, "prefix")
        elif rank == 0:
            bcp_megatron.BcpLoadShardedStrategy().remove_sharded_tensors(Path(path).as_uri(), "prefix")
        dist.barrier()
        keys = sorted(load_tensors_metadata(path))
        dist.barrier()
    return keys


@pytest.mark.parametrize("torch_dist_named", [False, True], ids=["url", "torch-dist-named"])
def test_removal_through_a_url(ranks, tmp_path, torch_dist_named):
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    assert ranks(2).run(remove_through_url, path, torch_dist_named) == [["keyA"], ["keyA"]]
    assert sorted(name for name in os.listdir(path) if name.startswith("gen-")) == ["gen-00000002"]
