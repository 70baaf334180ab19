"""Lightning fits checkpointing into bcp's memory tier (``BCPCheckpointIO(memory_tier=...)`` with
``MemoryTierCheckpoint``) and resuming from it (``trainer.fit(ckpt_path=MEMORY_TIER)``): real
Trainers under ``BCPDDPStrategy`` on 2 processes, simulated as 2 nodes of 1 rank
(``MemoryTier(nodes=...)``, a node-local folder each under a temporary ``local_dir``), and on one
device with the plugin alone.

One run saves every 2 steps to the tier (generations at steps 2, 4, 6, 8; the 3rd, step 6, also
to the persistent checkpoint) and stops at step 8; copies of its tier then lose one node's folder,
or both. Resumed on 2 ranks after losing one node, the fit restores the step-8 state bitwise from
the surviving node and its peer copies, without the persistent checkpoint (which is deleted). On 1
rank (the lost node not replaced) it restores the same state from the survivor. With both nodes'
folders gone it resumes from the persistent step 6. The reference for what a resume must give is
the same fit under ``BCPDDPStrategy`` saving with ``ModelCheckpoint`` into checkpoint folders at the
same steps, resumed from its step-8 and step-6 folders: the tier's resumes train with its losses,
step for step (mid-epoch: the train loader is stateful, its shuffled order replayed). Lightning's
own ``DDPStrategy`` run saves at the same steps and restores the same global step; its resumed
losses differ, as its shuffled loader draws a new order on resume.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

import bcp
from bcp_lightning import MEMORY_TIER, BCPCheckpointIO, MemoryTierCheckpoint
from lightning_launch import run
from lightning_worker import Data, LitMLP, full_state
from models import assert_bitwise
from tier_copies import copy_losing

pytestmark = pytest.mark.distributed

NODES = ["n0", "n1"]
EVERY, STOPPED_AT, PERSISTED_AT, TOTAL = 2, 8, 6, 12  # steps; an epoch has 6 on 2 ranks


def tier(root: str, copy: str, nodes: list[str]) -> dict:
    return {"persistent": f"{root}/{copy}/persistent", "local_dir": f"{root}/{copy}/shm", "persist_every": 3,
            "nodes": nodes}


def fit_tier(tier_args: dict, max_steps: int, resume: bool = False) -> dict:
    return {"case": "fit_tier", "args": {"strategy": "bcp_ddp", "tier": tier_args, "max_steps": max_steps,
                                         "every": EVERY, "resume": resume}}


def fit_lightning(dirpath: str, max_steps: int, resume: str | None = None) -> dict:
    """The same fit with Lightning's own DDPStrategy, ModelCheckpoint and TorchCheckpointIO."""
    return {"case": "fit_tier", "args": {"strategy": "ddp", "tier": None, "dirpath": dirpath, "max_steps": max_steps,
                                         "every": EVERY, "resume": resume or False}}


def fit_bcp_files(dirpath: str, max_steps: int, resume: str | None = None) -> dict:
    """The same fit under ``BCPDDPStrategy`` saving with ``ModelCheckpoint`` into checkpoint folders."""
    return {"case": "fit_tier", "args": {"strategy": "bcp_ddp", "tier": None, "dirpath": dirpath,
                                         "max_steps": max_steps, "every": EVERY, "resume": resume or False}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("lightning-tier"))
    first = run(2, [fit_tier(tier(root, "run", NODES), STOPPED_AT), fit_lightning(f"{root}/files", STOPPED_AT),
                    {"case": "tier_error", "args": {"strategy": "ddp", "tier": tier(root, "refused", NODES)}},
                    fit_bcp_files(f"{root}/bcp-files", STOPPED_AT)],
                f"{root}/launch-first")
    for copy in ("replaced", "fewer"):
        copy_losing(root, copy, lost=("n1",), persistent=False)
    copy_losing(root, "both_lost", lost=tuple(NODES), persistent=True)
    resumed = run(2, [fit_tier(tier(root, "replaced", NODES), TOTAL, resume=True),
                      fit_tier(tier(root, "both_lost", NODES), TOTAL, resume=True),
                      fit_lightning(f"{root}/files-8", TOTAL, resume=f"{root}/files/step={STOPPED_AT}.ckpt"),
                      fit_lightning(f"{root}/files-6", TOTAL, resume=f"{root}/files/step={PERSISTED_AT}.ckpt"),
                      fit_bcp_files(f"{root}/bcp-files-8", TOTAL, resume=f"{root}/bcp-files/step={STOPPED_AT}.ckpt"),
                      fit_bcp_files(f"{root}/bcp-files-6", TOTAL,
                                    resume=f"{root}/bcp-files/step={PERSISTED_AT}.ckpt")],
                  f"{root}/launch-resumed")
    (fewer,) = run(1, [fit_tier(tier(root, "fewer", NODES[:1]), TOTAL, resume=True)], f"{root}/launch-fewer")[0]
    return {"run": [r[0] for r in first], "lightning": [r[1] for r in first], "refused": [r[2] for r in first],
            "bcp_files": [r[3] for r in first], "bcp_files_8": [r[4] for r in resumed],
            "bcp_files_6": [r[5] for r in resumed],
            "replaced": [r[0] for r in resumed],
            "both_lost": [r[1] for r in resumed], "lightning_8": [r[2] for r in resumed],
            "lightning_6": [r[3] for r in resumed], "fewer": fewer}


def test_saves_go_to_the_tier_every_n_steps(runs):
    for rank in range(2):
        assert sorted(runs["run"][rank]["saved"]) == sorted(runs["lightning"][rank]["saved"]) == [2, 4, 6, 8]
        assert runs["run"][rank]["losses"] == runs["lightning"][rank]["losses"]


def test_a_replaced_node_resumes_from_peer_copies_as_lightning_resumes(runs):
    saved = runs["run"][0]["saved"][STOPPED_AT]
    for rank, lightning, files in zip(runs["replaced"], runs["lightning_8"], runs["bcp_files_8"]):
        assert rank["source"] == "memory", rank["reason"]
        assert rank["restored"]["global_step"] == lightning["restored"]["global_step"] == STOPPED_AT
        assert_bitwise(saved, rank["restored"]["state"])
        assert sorted(rank["losses"]) == list(range(STOPPED_AT + 1, TOTAL + 1))
        assert rank["losses"] == files["losses"]


def test_fewer_ranks_resume_from_the_surviving_node(runs):
    fewer = runs["fewer"]
    assert fewer["source"] == "memory", fewer["reason"]
    assert fewer["restored"]["global_step"] == STOPPED_AT
    assert_bitwise(runs["run"][0]["saved"][STOPPED_AT], fewer["restored"]["state"])


def test_with_both_nodes_lost_the_fit_resumes_from_the_persistent_copy(runs):
    saved = runs["run"][0]["saved"][PERSISTED_AT]
    for rank, files in zip(runs["both_lost"], runs["bcp_files_6"]):
        assert rank["source"] == "persistent", rank["reason"]
        assert rank["restored"]["global_step"] == PERSISTED_AT
        assert_bitwise(saved, rank["restored"]["state"])
        assert rank["losses"] == files["losses"]


def test_lightnings_own_ddp_strategy_is_refused_on_every_rank(runs):
    for message in runs["refused"]:
        assert message.startswith("CheckpointError") and "BCPDDPStrategy" in message, message


def _single_device_fit(plugin: BCPCheckpointIO, max_steps: int, **fit_args) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, plugins=[plugin], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, callbacks=[MemoryTierCheckpoint(every_n_train_steps=2)])
    trainer.fit(LitMLP(), datamodule=Data(stateful=True), **fit_args)
    return trainer


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_on_one_device_the_plugin_saves_to_its_tier_and_resumes_from_it(tmp_path, async_save):
    memory_tier = bcp.MemoryTier(tmp_path / "persistent", local_dir=tmp_path / "shm", persist_every=100)
    saved = full_state(_single_device_fit(BCPCheckpointIO(memory_tier=memory_tier, async_save=async_save),
                                          max_steps=4))
    plugin = BCPCheckpointIO(memory_tier=memory_tier)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, plugins=[plugin], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(LitMLP(), datamodule=Data(stateful=True), ckpt_path=MEMORY_TIER)  # at max_steps: restores only
    assert trainer.global_step == 4 and plugin.last_load.source == "memory"
    assert_bitwise(saved, full_state(trainer))


def test_a_plugin_without_a_tier_is_refused_by_the_callback_and_the_resume(tmp_path):
    with pytest.raises(bcp.CheckpointError, match="memory_tier=bcp.MemoryTier"):
        _single_device_fit(BCPCheckpointIO(), max_steps=2)
    with pytest.raises(bcp.CheckpointError, match="memory_tier=bcp.MemoryTier"):
        BCPCheckpointIO().load_checkpoint(MEMORY_TIER)


def test_an_empty_tier_is_a_checkpoint_not_found_error(tmp_path):
    memory_tier = bcp.MemoryTier(tmp_path / "persistent", local_dir=tmp_path / "shm")
    with pytest.raises(bcp.CheckpointNotFoundError):
        BCPCheckpointIO(memory_tier=memory_tier).load_checkpoint(MEMORY_TIER)
    assert not torch.distributed.is_initialized()

