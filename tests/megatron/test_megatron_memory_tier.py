"""Megatron-Core state in bcp's memory tier (``bcp_megatron.save_to_tier``/``load_from_tier``): a
GPT with the DistributedOptimizer (Adam) at (TP, PP, DP) = (2, 1, 2) on 4 gloo ranks, simulated as
2 nodes of 2 ranks (``MemoryTier(nodes=...)``, a node-local folder each under a temporary
``local_dir``), saved after 2 training steps with Megatron's common state (an ``iteration`` entry).

Copies of the tier then lose node ``n1``'s folder, or both nodes'. Node ``n1`` replaced (4 ranks
again, the persistent copy deleted too): every rank's model, main parameters and Adam state load
bitwise from ``n0`` and its peer copies, the common state comes back, and the next training step
has the uninterrupted run's loss, bitwise. Node ``n1`` not replaced: 2 ranks at (2, 1, 1) load the
survivor's copies resharded (the whole tensors equal the saved ones) and train on with the same
loss within floating-point tolerance (another reduction order). Both nodes lost: the persistent
copy loads, common state included."""

from __future__ import annotations

import math

import pytest
import torch

import bcp
import bcp_megatron
from megatron_parts import (assemble, assert_bitwise, cpu_megatron_optimizer, distributed_optimizer, gpt,
                            main_pieces, parallel, prime_for_load, restore_steps, scramble, sharded_state)
from megatron_training import train_step
from models import read_manifest
from tier_copies import copy_losing

FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
TRAINED_STEPS = 2
NODES = ("n0", "n0", "n1", "n1")


def tier(root: str, nodes: tuple[str, ...]) -> bcp.MemoryTier:
    return bcp.MemoryTier(f"{root}/persistent", local_dir=f"{root}/shm", persist_every=1, nodes=nodes)


def build(seed: int) -> tuple:
    model = gpt(seed=seed, num_layers=2, tied=False)
    ddp, optimizer = distributed_optimizer(model)
    return model, ddp, optimizer


def save(memory_tier: bcp.MemoryTier) -> tuple[list, float]:
    """Trains 2 steps at TP=2, saves to the tier; the saved pieces and the next step's loss."""
    with cpu_megatron_optimizer(), parallel(tp=2):
        model, ddp, optimizer = build(seed=1)
        for step in range(TRAINED_STEPS):
            train_step(ddp, optimizer, step)
        state = sharded_state(model, optimizer, FULLY_RESHARDABLE)
        bcp_megatron.save_to_tier({**state, "iteration": TRAINED_STEPS}, memory_tier)
        return main_pieces(sharded_state(model, optimizer, FULLY_RESHARDABLE)), train_step(ddp, optimizer, TRAINED_STEPS)


def resume(memory_tier: bcp.MemoryTier, tp: int) -> dict:
    """A fresh, scrambled model and optimizer loaded from the tier; what they hold and the next loss."""
    with cpu_megatron_optimizer(), parallel(tp=tp):
        model, ddp, optimizer = build(seed=2)
        scramble(model)
        prime_for_load(optimizer)
        loaded = bcp_megatron.load_from_tier(sharded_state(model, optimizer, FULLY_RESHARDABLE, is_loading=True),
                                             memory_tier)
        model.load_state_dict(loaded["model"])
        with torch.no_grad():  # fp32 parameters are their own main copies: views that require grad
            optimizer.load_state_dict(loaded["optimizer"])
        restore_steps(optimizer)
        return {"iteration": loaded["iteration"], "pieces": main_pieces(sharded_state(model, optimizer, FULLY_RESHARDABLE)),
                "loss": train_step(ddp, optimizer, TRAINED_STEPS)}


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory) -> tuple[str, list]:
    root = str(tmp_path_factory.mktemp("megatron-tier"))
    return root, ranks(4).run(save, tier(f"{root}/run", NODES))


def test_the_generation_records_the_states_iteration(saved):
    root, _ = saved
    assert read_manifest(f"{root}/run/persistent").step == TRAINED_STEPS


def test_a_replaced_node_resumes_bitwise_from_peer_copies(ranks, saved):
    root, per_rank = saved
    copy = copy_losing(root, "replaced", lost=("n1",), persistent=False)
    resumed = ranks(4).run(resume, tier(copy, NODES), 2)
    for (pieces, next_loss), rank in zip(per_rank, resumed):
        assert rank["iteration"] == TRAINED_STEPS
        assert_bitwise(assemble([pieces]), assemble([rank["pieces"]]))
        assert rank["loss"] == next_loss


def test_the_surviving_node_alone_resumes_resharded(ranks, saved):
    root, per_rank = saved
    copy = copy_losing(root, "fewer", lost=("n1",), persistent=False)
    resumed = ranks(2).run(resume, tier(copy, NODES[:2]), 2)
    assert_bitwise(assemble([pieces for pieces, _ in per_rank]), assemble([rank["pieces"] for rank in resumed]))
    for rank in resumed:
        assert rank["iteration"] == TRAINED_STEPS
        assert math.isclose(rank["loss"], per_rank[0][1], rel_tol=1e-5)


def test_with_both_nodes_lost_the_persistent_copy_loads(ranks, saved):
    root, per_rank = saved
    copy = copy_losing(root, "both_lost", lost=("n0", "n1"), persistent=True)
    resumed = ranks(4).run(resume, tier(copy, NODES), 2)
    for (pieces, next_loss), rank in zip(per_rank, resumed):
        assert rank["iteration"] == TRAINED_STEPS
        assert_bitwise(assemble([pieces]), assemble([rank["pieces"]]))
        assert rank["loss"] == next_loss


def test_a_folder_is_refused_with_the_way_out(tmp_path):
    with pytest.raises(TypeError, match="dist_checkpointing.save/load"):
        bcp_megatron.save_to_tier({}, str(tmp_path))
