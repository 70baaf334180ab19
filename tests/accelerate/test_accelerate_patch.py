"""Where bcp_accelerate reaches into accelerate's dataloaders beyond its public API
(``accelerate_patch``): this test fails when an accelerate upgrade moves a name it relies on."""

from __future__ import annotations

import importlib.metadata
import inspect

import accelerate
from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, SeedableRandomSampler

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
