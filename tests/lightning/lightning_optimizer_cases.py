"""The Lightning half of the optimizer-semantics cases (``optimizer_cases``), run by
``lightning_worker``: for each optimizer of ``torch.optim`` with each of its options, a Trainer
trains a few steps and saves through bcp; a second Trainer resumes from that checkpoint, and at the
start of its training (everything restored, no step taken) its optimizer's ``state_dict()`` is
compared with torch's ``load_state_dict`` of the first run's ``state_dict()``."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from optimizer_cases import STEPS, OptimizerCase, case_by_id, differences, loaded_by_torch, model_for, refusal, \
    saved_state

SAMPLES = 16
# Read once: Lightning's environment deletes WORLD_SIZE from os.environ when a run tears down.
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


class LitCase(L.LightningModule):
    """The case's model and optimizer; FSDP2 shards it in ``configure_model`` as the strategy's mesh says."""

    def __init__(self, case_id: str, fsdp2: bool) -> None:
        super().__init__()
        self.case, self.fsdp2 = case_by_id(case_id), fsdp2
        with torch.random.fork_rng():
            torch.manual_seed(1)
            self.net = model_for(self.case)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.fsdp2 and not isinstance(self.net, FSDPModule):
            mesh = self.device_mesh["data_parallel"]
            for child in self.net.children():
                fully_shard(child, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return self.case.make(self.parameters())


class CompareAtStart(Callback):
    """At the start of a resumed run: the optimizer's differences from torch's load of ``saved``."""

    def __init__(self, case: OptimizerCase, saved: dict[str, Any]) -> None:
        self.case, self.saved = case, saved
        self.found: list[str] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        expected = loaded_by_torch(self.case, pl_module, self.saved).state_dict()
        self.found = differences(expected, trainer.optimizers[0].state_dict())


def _trainer(strategy: Any, plugins: Any, steps: int, callbacks: list[Callback]) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy(),
                     plugins=plugins(), max_steps=steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                     callbacks=callbacks)


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 12, generator=g), torch.randn(SAMPLES, 7, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def compare_cases(strategy: Any, plugins: Any, fsdp2: bool, dirpath: str, case_ids: list[str],
                  steps: int = STEPS) -> dict[str, list[str]]:
    """Per case, trained ``steps`` (0: saved before any step): its differences from torch, or
    ``skipped: <torch's error>`` where training fails."""
    found: dict[str, list[str]] = {}
    for number, case_id in enumerate(case_ids):
        path = f"{dirpath}/{number}.ckpt"
        trainer = _trainer(strategy, plugins, steps, [])
        # torch's refusal shows in training: a run saved before any step is tried with one first
        tried = _trainer(strategy, plugins, 1, []) if steps == 0 else trainer
        refused = refusal(lambda: tried.fit(LitCase(case_id, fsdp2), train_dataloaders=_data()))
        if refused is not None:
            found[case_id] = [f"skipped: {refused}"]
            continue
        if steps == 0:
            trainer.fit(LitCase(case_id, fsdp2), train_dataloaders=_data())
        trainer.save_checkpoint(path)
        compare = CompareAtStart(case_by_id(case_id), saved_state(trainer.optimizers[0]))
        _trainer(strategy, plugins, steps + 1, [compare]).fit(LitCase(case_id, fsdp2), train_dataloaders=_data(),
                                                              ckpt_path=path)
        found[case_id] = compare.found if compare.found is not None else ["the resumed run did not start"]
    return found
