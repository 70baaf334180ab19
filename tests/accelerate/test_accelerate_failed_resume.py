"""A ``load_state`` through bcp whose load fails (a parameter under another name, one of another
shape, a flipped byte in a data file) raises a ``bcp.CheckpointError`` naming what is wrong and
leaves the model and the optimizer's ``state_dict()`` (deep, every tensor byte) as they were: for a
never-stepped optimizer, and for one already stepped that holds no state yet for a layer its steps
did not reach. Guards a past defect: the missing optimizer state was created (a step at a zero
learning rate) before loading, so a failed resume left a fresh AdamW at ``step=1``."""

from __future__ import annotations

import copy
import shutil

import torch
from accelerate_helpers import Net, build, session, train
from torch import nn

import bcp
from models import read_manifest
from optimizer_cases import differences
from tools.tools_checkpoints import flip_byte

FAILURES = {"name": "mlp.fc1.weight", "shape": "fc2.weight", "flipped-byte": "fc1.weight"}


def _model(failure: str) -> nn.Module:
    torch.manual_seed(2)
    model = Net()
    if failure == "name":
        model.renamed = model.mlp
        del model.mlp
    elif failure == "shape":
        model.mlp.fc2 = nn.Linear(22, 8)
    return model


def failed_resumes(workdir: str) -> dict[str, list[str]]:
    """For each failure, with a fresh and a stepped optimizer: what the failing ``load_state``
    changed, and its message where it does not name the tensor."""
    saved, damaged = f"{workdir}/saved", f"{workdir}/damaged"
    with session("bcp") as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=1)
        train(accelerator, model, optimizer, scheduler, range(2))
        accelerator.save_state(saved)
    shutil.copytree(saved, damaged)
    flip_byte(damaged, next(name for name in read_manifest(damaged).tensors if name.endswith(FAILURES["flipped-byte"])))
    found: dict[str, list[str]] = {}
    for failure, tensor in FAILURES.items():
        for steps in (0, 2):
            with session("bcp") as accelerator:
                module = _model(failure)
                model, optimizer = accelerator.prepare(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
                stepped = [p for name, p in model.named_parameters() if "fc2" not in name]  # fc2 gets no state
                for _ in range(steps):
                    for p in stepped:
                        p.grad = torch.randn_like(p)
                    optimizer.step()
                before = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
                try:
                    accelerator.load_state(damaged if failure == "flipped-byte" else saved)
                except bcp.CheckpointError as error:
                    problems = [] if tensor in str(error) else [f"message: {error}"]
                else:
                    problems = ["raised nothing"]
                found[f"{failure}/{steps}"] = problems + differences(
                    before, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    return found


def test_a_failed_load_state_leaves_the_model_and_optimizer_as_they_were(ranks, tmp_path):
    (found,) = ranks(1).run(failed_resumes, str(tmp_path))
    assert len(found) == 2 * len(FAILURES)
    assert not {case: problems for case, problems in found.items() if problems}
