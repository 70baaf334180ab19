"""``save_state``/``load_state`` into bcp's memory tier through a real Accelerator on 2 gloo
processes, simulated as 2 nodes of 1 process (``MemoryTier(nodes=...)``, a node-local folder each
under a temporary ``local_dir``).

Accelerate's own files (scheduler, RNG states) have no folder in a tier: they are saved in the
checkpoint itself, so they are replicated and persisted with the tensors. One save after 3 steps
(persisted: ``persist_every=1``); copies of the tier then lose one node's folder, or both. Losing
one, with the persistent copy deleted too, 2 processes resume from the survivor and the peer copies:
model, optimizer, scheduler, step and every RNG are restored bitwise and the next steps (with
dropout) equal an uninterrupted run's; 1 process (the node not replaced) resumes resharded. Losing
both, the resume comes from the persistent copy, accelerate's files included.
"""

from __future__ import annotations

import math
import os

import pytest

import bcp
import bcp_accelerate
from accelerate_helpers import (
    SAVED_AT,
    STEPS,
    build,
    load_on_one_process,
    resume_matches_uninterrupted,
    session,
    snapshot,
    train,
)
from models import read_manifest
from tier_copies import copy_losing

NODES = ("n0", "n1")


def tier(root: str, nodes: tuple[str, ...] = NODES) -> bcp.MemoryTier:
    return bcp.MemoryTier(f"{root}/persistent", local_dir=f"{root}/shm", persist_every=1, nodes=nodes)


def save_to_the_tier(memory_tier: bcp.MemoryTier) -> dict:
    with session() as accelerator:
        bcp_accelerate.enable(accelerator, memory_tier=memory_tier)
        model, optimizer, scheduler = build(accelerator, seed=1)
        train(accelerator, model, optimizer, scheduler, range(SAVED_AT))
        assert accelerator.save_state() == memory_tier  # no folder: the accelerator's tier
        assert accelerator.project_configuration.iteration == 1
        return snapshot(accelerator, model, optimizer, scheduler)


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("accelerate-tier"))
    return root, ranks(2).run(save_to_the_tier, tier(f"{root}/run"))


def test_accelerates_files_are_in_the_checkpoint_not_beside_it(saved):
    root, _ = saved
    assert sorted(os.listdir(f"{root}/run/shm")) == ["node-n0", "node-n1"]
    persistent = f"{root}/run/persistent"
    assert not [name for name in os.listdir(persistent) if name.startswith("accelerate-")]
    assert "accelerate_files" in read_manifest(persistent).objects


def test_the_generation_records_accelerates_step(saved):
    root, snapshots = saved
    assert read_manifest(f"{root}/run/persistent").step == snapshots[0]["step"]


def test_a_replaced_node_resumes_from_peer_copies_exactly(ranks, saved):
    root, snapshots = saved
    copy = copy_losing(root, "replaced", lost=("n1",), persistent=False)
    ranks(2).run(resume_matches_uninterrupted, tier(copy), snapshots, False)


def test_one_process_resumes_from_the_surviving_node(ranks, saved):
    root, snapshots = saved
    copy = copy_losing(root, "fewer", lost=("n1",), persistent=False)
    losses = ranks(1).run(load_on_one_process, tier(copy, NODES[:1]), snapshots[0])[0]
    assert len(losses) == STEPS - SAVED_AT and all(math.isfinite(loss) for loss in losses)


def test_with_both_nodes_lost_the_persistent_copy_restores_everything(ranks, saved):
    root, snapshots = saved
    copy = copy_losing(root, "both_lost", lost=NODES, persistent=True)
    ranks(2).run(resume_matches_uninterrupted, tier(copy), snapshots, False)


def save_to_a_folder_and_to_the_tier(folder: str, memory_tier: bcp.MemoryTier) -> list[str]:
    with session() as accelerator:
        bcp_accelerate.enable(accelerator, memory_tier=memory_tier)
        build(accelerator, seed=1)
        accelerator.save_state(folder)  # a folder given still goes to the folder
        accelerator.save_state(memory_tier)  # a tier given goes to it, with or without enable's
        accelerator.load_state(folder)
        return sorted(os.listdir(folder))


def test_a_folder_given_still_goes_to_the_folder(ranks, tmp_path):
    names = ranks(1).run(save_to_a_folder_and_to_the_tier, str(tmp_path / "folder"),
                         tier(str(tmp_path), ("n0",)))[0]
    assert "gen-00000001" in names and any(name.startswith("accelerate-") for name in names)
    assert os.listdir(tmp_path / "shm" / "node-n0")


def resume_from_the_tier(memory_tier: bcp.MemoryTier) -> str:
    with session() as accelerator:
        bcp_accelerate.enable(accelerator, memory_tier=memory_tier)
        build(accelerator, seed=1)
        try:
            accelerator.load_state()
        except bcp.CheckpointNotFoundError as exc:
            return str(exc)
        return "no error"


def test_an_empty_tier_is_a_checkpoint_not_found_error(ranks, tmp_path):
    message = ranks(1).run(resume_from_the_tier, tier(str(tmp_path), ("n0",)))[0]
    assert "nothing to load" in message
