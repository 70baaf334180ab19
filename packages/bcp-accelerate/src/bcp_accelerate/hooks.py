"""The user's ``register_save_state_pre_hook``/``register_load_state_pre_hook`` hooks, run with the
arguments accelerate gives them, and the models they leave to bcp.

A hook takes a model over by removing it from the list it gets (its state dict from ``weights`` on
save, the model from ``models`` on load), as diffusers' training scripts do. Accelerate's own save
writes on the main process, so what the hooks leave there decides for every rank. Under FSDP
accelerate saves and loads the models before the hooks run and hands them none, so bcp handles
every model.
Edits a hook makes to a state dict in ``weights`` are not saved: bcp saves the live model.
"""

from __future__ import annotations

import accelerate
from accelerate.utils import DistributedType

from bcp_accelerate.accelerate_patch import prepared, state_pre_hooks


def models_to_save(accelerator: accelerate.Accelerator, output_dir: str) -> list[int]:
    """Run the save hooks; the indices of the models whose state dict they left in ``weights``."""
    models = prepared(accelerator, "models")
    hooks = state_pre_hooks(accelerator, "save")
    offered = [] if _fsdp(accelerator) or not hooks else [accelerator.get_state_dict(m, unwrap=False) for m in models]
    weights = list(offered)
    for hook in hooks:
        hook(models, weights, output_dir)
    return _still_there(models, offered, weights)


def models_to_load(accelerator: accelerate.Accelerator, input_dir: str) -> list[int]:
    """Run the load hooks; the indices of the models they left in the list."""
    models = prepared(accelerator, "models")
    offered = [] if _fsdp(accelerator) else list(models)
    remaining = list(offered)
    for hook in state_pre_hooks(accelerator, "load"):
        hook(remaining, input_dir)
    return _still_there(models, offered, remaining)


def _fsdp(accelerator: accelerate.Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP


def _still_there(models: list, offered: list, remaining: list) -> list[int]:
    if not offered:
        return list(range(len(models)))
    return [i for i, item in enumerate(offered) if any(item is r for r in remaining)]

