"""bcp_lightning checkpoints without a Trainer.

``LightningModule.load_from_checkpoint`` reads a torch file (it opens the path and ``torch.load``s
it, with no plugin or strategy to route it through), so on a bcp checkpoint, which is a directory,
it fails with ``IsADirectoryError``. ``load_from_checkpoint(MyModule, path)`` here does what it does
on any checkpoint bcp_lightning wrote or reads: builds the module from the saved hyper-parameters
(with Lightning's own code, so overrides, ``strict`` and ``on_load_checkpoint`` behave the same)
and loads the weights. ``load(path, model, optimizers)`` loads into modules and optimizers you
built, whichever way the optimizer state was saved.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from bcp_lightning import convert, lightning_patch, paths
from bcp_lightning.io import CheckpointIOMixin
from bcp_lightning.live_state import TORCH_STATE_DICTS


def load(path: Any, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (), *,
         strict: bool = True, allow_pickle: bool = False) -> dict[str, Any]:
    """Load a bcp_lightning checkpoint into ``model`` and ``optimizers`` (in the order
    ``configure_optimizers`` returned them); every rank of a process group calls it, or one process
    alone. Returns Lightning's other entries (``epoch``, ``global_step``, ``hyper_parameters``,
    ``loops``, ...). The optimizer state may have been saved by a strategy (keyed by parameter name,
    resharded into the live layout) or by the plugin under Lightning's own DDP or single-device
    strategy (keyed by index, loaded as ``optimizer.load_state_dict`` takes it)."""
    optimizers = list(optimizers)
    reader = CheckpointIOMixin(allow_pickle=allow_pickle)
    model_state = TORCH_STATE_DICTS.model(model)
    optimizer_states = [TORCH_STATE_DICTS.optimizer(model, o, for_load=True) for o in optimizers]
    checkpoint = reader.load_into(path, model_state, optimizer_states, strict=strict)
    TORCH_STATE_DICTS.load_model(model, model_state, strict=strict)
    if optimizers and convert.OPTIMIZER_STATES in checkpoint:
        for optimizer, state in zip(optimizers, checkpoint.pop(convert.OPTIMIZER_STATES)):
            optimizer.load_state_dict(state)
    else:
        for optimizer, state in zip(optimizers, optimizer_states):
            TORCH_STATE_DICTS.load_optimizer(model, optimizer, state)
    return checkpoint


def load_from_checkpoint(cls: type, path: Any, *, strict: bool | None = None, allow_pickle: bool = False,
                         **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path, strict=strict, **kwargs)`` for a bcp checkpoint (a torch
    file goes to Lightning's own): the module built from the saved hyper-parameters (``kwargs``
    override them), its weights loaded on the CPU."""
    location = os.fspath(path)
    if paths.is_single_file(location):
        return cls.load_from_checkpoint(location, strict=strict, **kwargs)
    checkpoint = CheckpointIOMixin(allow_pickle=allow_pickle).load_checkpoint(location)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    return lightning_patch.module_from_checkpoint(cls, checkpoint, strict=strict, **kwargs)

