"""Where bcp_accelerate reaches into accelerate's dataloaders beyond its public API
(``accelerate_patch``): this test fails when an accelerate upgrade moves a name it relies on."""

from __future__ import annotations

import importlib.metadata
import inspect

import accelerate
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, SeedableRandomSampler

from bcp.integration import MovedNameError
from bcp_accelerate import accelerate_patch


def test_the_installed_accelerate_is_one_bcp_accelerate_follows():
    version = tuple(int(p) for p in importlib.metadata.version("accelerate").split(".")[:2])
    assert accelerate_patch.TESTED[0] <= version < accelerate_patch.TESTED[1]
    assert accelerate_patch.unavailable() is None
    assert getattr(accelerate.Accelerator.prepare_data_loader, "_bcp_follows_orders", False)


def test_the_names_read_and_set_exist():
    shard = BatchSamplerShard([[0], [1]], num_processes=2, process_index=1)
    assert (shard.num_processes, shard.process_index, shard.split_batches, shard.even_batches) == (2, 1, False, True)
    assert shard.batch_sampler == [[0], [1]]
    assert "iteration" in inspect.signature(DataLoaderShard.__init__).parameters
    assert SeedableRandomSampler(range(4), data_seed=3).initial_seed == 3


def test_another_accelerate_version_is_left_unpatched_with_the_reason(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.1.0")
    assert accelerate_patch._why_not() == ("accelerate 2.1 is outside the versions bcp_accelerate follows the "
                                           "dataloaders of (1.0 to before 2.0)")


def test_what_the_accelerator_prepared_and_its_hooks_are_read_by_name():
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = torch.utils.data.DataLoader(range(4), batch_size=2)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    accelerator.register_for_checkpointing(counter := Counter())
    saving, loading = accelerator.register_save_state_pre_hook(print), accelerator.register_load_state_pre_hook(len)
    try:
        assert accelerate_patch.prepared(accelerator, "models") == [model]
        assert accelerate_patch.prepared(accelerator, "optimizers") == [optimizer]
        assert accelerate_patch.prepared(accelerator, "schedulers") == [scheduler]
        assert accelerate_patch.prepared(accelerator, "dataloaders") == [loader]
        assert accelerate_patch.prepared(accelerator, "custom_objects") == [counter]
        assert accelerate_patch.state_pre_hooks(accelerator, "save") == [print]
        assert accelerate_patch.state_pre_hooks(accelerator, "load") == [len]
    finally:
        saving.remove(), loading.remove()


def test_a_moved_name_fails_naming_it_and_the_tested_versions():
    with pytest.raises(MovedNameError, match=r"Accelerator\._models is missing: bcp reads this private name of "
                                             r"accelerate, tested with accelerate 1\.0 to before 2\.0"):
        accelerate_patch.prepared(object.__new__(accelerate.Accelerator), "models")


class Counter:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
