"""A resume through ``BCPDDPStrategy`` whose load fails (a parameter under another name, one of
another shape, a flipped byte in a data file) raises a ``bcp.CheckpointError`` naming what is wrong
and leaves the model and the optimizer's ``state_dict()`` (deep, every tensor byte) as they were:
for a never-stepped optimizer, and for one already stepped that holds no state yet for a layer its
steps did not reach. Guards a past defect: the strategy created the missing optimizer state (a step
at a zero learning rate) before loading, so a failed resume left a fresh AdamW at ``step=1``."""

from __future__ import annotations

import copy
import shutil
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn

import bcp
from bcp_lightning import BCPDDPStrategy
from lightning_worker import Data, LitMLP
from models import read_manifest
from optimizer_cases import differences
from tools.tools_checkpoints import flip_byte

FAILURES = {"name": "net.fc1.weight", "shape": "fc2.weight", "flipped-byte": "fc1.weight"}


class GivenOptimizer(LitMLP):
    """``LitMLP`` whose ``configure_optimizers`` returns an AdamW made (and perhaps stepped) beforehand,
    its parameters renamed or reshaped as ``failure`` asks."""

    def __init__(self, failure: str, steps: int) -> None:
        super().__init__()
        if failure == "name":
            self.renamed = self.net
            del self.net
        elif failure == "shape":
            self.net.fc2 = nn.Linear(22, 8)
        self.given = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        stepped = [p for name, p in self.named_parameters() if "fc2" not in name]  # fc2 gets no state
        for _ in range(steps):
            for p in stepped:
                p.grad = torch.randn_like(p)
            self.given.step()

    def configure_optimizers(self) -> Any:
        return self.given


def trainer() -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, strategy=BCPDDPStrategy(), max_steps=2, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     enable_checkpointing=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("failed_resume") / "trained.ckpt")
    run = trainer()
    run.fit(LitMLP(), datamodule=Data(shuffle=False))
    run.save_checkpoint(path)
    yield path
    if dist.is_initialized():  # the strategy's process group; later tests expect none
        dist.destroy_process_group()


@pytest.mark.parametrize("steps", [0, 2], ids=["fresh", "stepped"])
@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failed_resume_leaves_the_model_and_optimizer_as_they_were(saved, tmp_path, failure, steps):
    path = saved
    if failure == "flipped-byte":
        path = str(tmp_path / "damaged.ckpt")
        shutil.copytree(saved, path)
        flip_byte(path, next(name for name in read_manifest(path).tensors if name.endswith(FAILURES[failure])))
    module = GivenOptimizer(failure, steps)
    assert sum(1 for state in module.given.state.values() if state) == (4 if steps else 0)
    before = copy.deepcopy({"model": module.state_dict(), "optimizer": module.given.state_dict()})
    with pytest.raises(bcp.CheckpointError, match=FAILURES[failure]):
        trainer().fit(module, datamodule=Data(shuffle=False), ckpt_path=path)
    assert not differences(before, {"model": module.state_dict(), "optimizer": module.given.state_dict()})

