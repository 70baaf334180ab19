"""An accelerator's prepared models and optimizers as the ``model`` and ``optimizer`` components
that bcp reshards.

A single prepared model is the ``model`` component itself, so the checkpoint holds the model's own
parameter names and also loads with a plain ``bcp.load(path, {"model": module})``; several models
become the children ``model_<i>`` of one container. All optimizers together become one FQN-keyed
optimizer state dict (per-parameter state by name, the param groups of each optimizer in turn), so
any number of optimizers over any of the models is saved once and resharded.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

from bcp import AdapterError
from bcp.integration import replace_state, state_to_load_into

PARAMS = "params"


def torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer inside accelerate's wrapper, whose ``step`` is not skipped while gradients
    accumulate (bcp steps it with a zero learning rate to create missing state before a load)."""
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def model_component(models: Sequence[nn.Module], indices: Sequence[int]) -> nn.Module | None:
    """The models at ``indices`` as one module named consistently with :func:`optimizer_component`."""
    if not indices:
        return None
    if len(models) == 1:
        return models[0]
    return nn.ModuleDict({f"model_{i}": models[i] for i in indices})


def optimizer_component(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], *,
                        for_load: bool) -> dict[str, Any]:
    """One FQN-keyed optimizer state dict over every optimizer; its per-parameter dicts are the live
    ones. With ``for_load``, parameters without state get the state one step would create, so that
    there is something to load into, without changing the optimizers (a load that fails leaves them
    as they were; :func:`restore_optimizers` gives them what one that succeeds loaded)."""
    inner = [torch_optimizer(o) for o in optimizers]
    names = _parameter_names(models)
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for index, optimizer in enumerate(inner):
        live = state_to_load_into(optimizer) if for_load else optimizer.state
        for group in optimizer.param_groups:
            params = [_name_of(names, p, index) for p in group[PARAMS]]
            groups.append({**{k: v for k, v in group.items() if k != PARAMS}, PARAMS: params})
            state.update({name: live[p] for name, p in zip(params, group[PARAMS]) if p in live})
    return {"state": state, "param_groups": groups}


def restore_optimizers(component: dict[str, Any], models: Sequence[nn.Module],
                       optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Give each optimizer the state and hyper-parameters loaded into ``component`` (as
    :func:`optimizer_component` made it), as ``Optimizer.load_state_dict`` gives them: a parameter
    the checkpoint holds no state for has none."""
    names = _parameter_names(models)
    groups = iter(component["param_groups"])
    for index, optimizer in enumerate(torch_optimizer(o) for o in optimizers):
        fqns = [[_name_of(names, p, index) for p in group[PARAMS]] for group in optimizer.param_groups]
        replace_state(optimizer, fqns, component["state"], [next(groups) for _ in fqns])


def _parameter_names(models: Sequence[nn.Module]) -> dict[int, str]:
    every = model_component(models, range(len(models)))
    return {} if every is None else {id(p): name for name, p in every.named_parameters()}


def _name_of(names: dict[int, str], param: torch.Tensor, optimizer_index: int) -> str:
    name = names.get(id(param))
    if name is None:
        raise AdapterError(
            f"optimizer {optimizer_index} updates a parameter of shape {tuple(param.shape)} that is in none of the "
            "prepared models; bcp names optimizer state by parameter name, so pass the module that owns it "
            "through accelerator.prepare() too")
    return name
