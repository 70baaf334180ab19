"""Incremental saves to the memory tier (2 ranks as 2 nodes, ``nodes=``): the later generations refer
to the first one's files in each node's folder, whose peer copies hold what every generation needs
(a replaced node receives the earlier files it lacks); the tier loads bitwise on one rank and on
three, and a persisted generation is a checkpoint of its own at the persistent path."""

from __future__ import annotations

import os
import shutil

import bcp
from bcp.tools import open_checkpoint
from lora_models import SAVES, assert_round_trip, load_generation, save_fine_tuning
from models import assert_bitwise


def _tier(root: str, nodes: list[str]) -> bcp.MemoryTier:
    return bcp.MemoryTier(os.path.join(root, "persistent"), local_dir=os.path.join(root, "tier"), nodes=nodes,
                          persist_every=SAVES)


def _on(root: str):
    """The tier as a job of ``world`` ranks names it: node a, then node b."""
    return lambda world: _tier(root, ["a", "b", "b"][:world] if world > 1 else ["a"])


def test_a_frozen_base_saved_three_times_to_the_tier_loads_bitwise_on_one_and_three(ranks, tmp_path):
    root = str(tmp_path)
    saves = ranks(2).run(save_fine_tuning, "fsdp2", _tier(root, ["a", "b"]), True)
    for node in ("a", "b"):  # generation 1 stays in each folder: 3 lists its files (and their copies)
        assert sorted(p.name for p in (tmp_path / "tier" / f"node-{node}").glob("gen-*")) == \
            ["gen-00000001", "gen-00000003"]
    assert_round_trip(ranks, _on(root), saves, generations=False)
    persisted = open_checkpoint(tmp_path / "persistent").manifest  # the third save, on its own
    assert persisted.version < 3 and not persisted.earlier_generations()
    assert persisted.total_tensor_bytes() == open_checkpoint(tmp_path / "tier" / "node-a").manifest.total_tensor_bytes()
    assert_bitwise(saves[0][-1]["state"], load_generation("plain", str(tmp_path / "persistent"), None)["state"])


def save_after_replacement(root: str, saves: list) -> dict:
    """One more incremental save by the same processes, node b's folder emptied (replaced) before."""
    from lora_models import build_lora
    from models import train

    model, optimizer = build_lora("fsdp2", seed=1)
    train(model, optimizer, range(9))
    handle = bcp.save(_tier(root, ["a", "b"]), {"model": model, "optimizer": optimizer, "extra_state": {"save": 9}},
                      incremental=True)
    from models import full_state, rank

    state = full_state(model, optimizer)
    return {"reused": handle.stats.reused_bytes, "state": state if rank() == 0 else None}


def test_a_replaced_node_receives_the_earlier_files_the_new_generation_refers_to(ranks, tmp_path):
    root = str(tmp_path)
    ranks(2).run(save_fine_tuning, "fsdp2", _tier(root, ["a", "b"]), False)
    shutil.rmtree(tmp_path / "tier" / "node-b")  # replaced: empty
    after = ranks(2).run(save_after_replacement, root, [])
    assert after[0]["reused"] > 0 and after[1]["reused"] == 0  # node b's rank holds nothing to refer to
    shutil.rmtree(tmp_path / "tier" / "node-a")  # now node a is lost: node b must hold all of it
    loaded = ranks(2).run(load_generation, "fsdp2", _tier(root, ["b", "b"]), None)
    assert loaded[0]["extra"] == {"save": 9}
    assert_bitwise(after[0]["state"], loaded[0]["state"])
