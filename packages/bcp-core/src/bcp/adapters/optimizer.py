"""Optimizer state keyed by parameter FQN, for ``torch.optim.Optimizer`` objects and for the
FQN-keyed dicts of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``.

Names: ``state/<param fqn>/<state key>`` for per-parameter state (tensors follow the parameter's
sharding), ``param_groups`` for the groups' hyper-parameters with parameters listed by FQN.

Loaded values go back as ``torch.optim.Optimizer.load_state_dict`` gives them: the state of a
parameter with no loaded state is removed, hyper-parameters are the saved ones.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from bcp.adapters.fqn import canonical, canonical_map
from bcp.errors import AdapterError, MismatchError
from bcp.layout.shards import is_tensor_value

STATE = "state/"
PARAM_GROUPS = "param_groups"


def optimizer_values(model: Any, optimizer: Any, *, for_load: bool) -> dict[str, Any]:
    if isinstance(optimizer, Mapping):
        return _dict_values(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise AdapterError(f"'optimizer' must be a torch.optim.Optimizer or an FQN-keyed state dict, "
                           f"got {type(optimizer).__name__}")
    names = _param_names(model)
    if for_load:
        initialize_state(optimizer)
    group_names = [_group_names(names, g["params"], i) for i, g in enumerate(optimizer.param_groups)]
    values: dict[str, Any] = {}
    for group, fqns in zip(optimizer.param_groups, group_names):
        for param, fqn in zip(group["params"], fqns):
            for key, value in optimizer.state.get(param, {}).items():
                values[f"{STATE}{fqn}/{key}"] = value
    values[PARAM_GROUPS] = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": fqns}
        for g, fqns in zip(optimizer.param_groups, group_names)
    ]
    return values


def _group_names(names: dict[int, str], params: list[Any], group: int) -> list[str]:
    """The model FQNs of a param group's parameters; a parameter the model does not hold is named
    by its place in the optimizer and its shape."""
    for index, param in enumerate(params):
        if id(param) not in names:
            raise AdapterError(
                f"the optimizer's param group {group} holds a parameter (index {index}, shape "
                f"{list(param.shape)}, dtype {param.dtype}) that is not a parameter of the model it is saved with "
                "(the module of the state holding most of its parameters); save the module it belongs to beside "
                "it (one optimizer per module), or give the optimizer only that module's parameters",
                key="optimizer")
    return [names[id(p)] for p in params]


def nested_optimizer_state(values: Mapping[str, Any]) -> dict[str, Any]:
    """Optimizer values as torch's FQN-keyed optimizer state dict:
    ``{"state": {fqn: {key: value}}, "param_groups": [...]}``."""
    state: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        if name.startswith(STATE):
            fqn, key = name[len(STATE):].rsplit("/", 1)
            state.setdefault(fqn, {})[key] = value
    return {"state": state, "param_groups": values[PARAM_GROUPS]}


def flat_optimizer_values(osd: Mapping[str, Any]) -> dict[str, Any]:
    """The reverse of :func:`nested_optimizer_state`."""
    values = {f"{STATE}{fqn}/{key}": value for fqn, per_param in osd["state"].items() for key, value in per_param.items()}
    values[PARAM_GROUPS] = osd["param_groups"]
    return values


def apply_optimizer_values(model: Any, optimizer: Any, values: dict[str, Any]) -> None:
    """Set hyper-parameters and non-tensor state (tensors were already filled in place), and remove
    the state of parameters that ``values`` holds none for."""
    if isinstance(optimizer, Mapping):
        _apply_to_dict(optimizer, values)
        return
    names = _param_names(model)
    by_name = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    loaded = _params_with_state(values)
    for fqn, param in by_name.items():
        if fqn not in loaded:
            optimizer.state.pop(param, None)
    for name, value in values.items():
        if name.startswith(STATE) and not is_tensor_value(value):
            fqn, key = name[len(STATE):].rsplit("/", 1)
            optimizer.state[by_name[fqn]][key] = value
    if PARAM_GROUPS in values:
        _apply_groups(optimizer.param_groups, values[PARAM_GROUPS],
                      [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups])


def initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Create missing per-parameter state by one step with zero gradients and a zero learning rate,
    so a never-stepped optimizer has tensors to load into. Parameters do not change: every update
    is scaled by the learning rate; other parameters' gradients are set aside for the step."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if not missing:
        return
    missing_ids = {id(p) for p in missing}
    saved_grads = {id(p): p.grad for p in params}
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in missing_ids else None
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved_lrs):
            g["lr"] = lr
        for p in params:
            p.grad = saved_grads[id(p)]


def _param_names(model: Any) -> dict[int, str]:
    if not isinstance(model, torch.nn.Module):
        raise AdapterError("an Optimizer object needs the model in state['model'] (an nn.Module) to name "
                           "its parameters; or pass an FQN-keyed optimizer state dict")
    return {id(p): canonical(n) for n, p in model.named_parameters()}


def _dict_values(osd: Mapping[str, Any]) -> dict[str, Any]:
    state = osd.get("state")
    groups = osd.get("param_groups")
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        raise AdapterError("an optimizer state dict needs 'state' (a dict) and 'param_groups' (a list)")
    if any(not isinstance(k, str) for k in state):
        raise AdapterError(
            "this optimizer state dict is keyed by parameter index (a raw optimizer.state_dict()), which "
            "cannot be resharded; pass the Optimizer object itself, or the FQN-keyed dict from "
            "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer)")
    values: dict[str, Any] = {}
    for fqn, per_param in canonical_map(state).items():
        for key, value in state[per_param].items():
            values[f"{STATE}{fqn}/{key}"] = value
    values[PARAM_GROUPS] = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [canonical(p) for p in g["params"]]}
        for g in groups
    ]
    return values


def _params_with_state(values: Mapping[str, Any]) -> set[str]:
    return {name[len(STATE):].rsplit("/", 1)[0] for name in values if name.startswith(STATE)}


def _apply_to_dict(osd: Any, values: dict[str, Any]) -> None:
    loaded = _params_with_state(values)
    for original, fqn in [(o, canonical(o)) for o in osd["state"]]:
        if fqn not in loaded:  # cleared too: the dict may be the live optimizer's own per-parameter state
            osd["state"].pop(original).clear()
    originals = canonical_map(osd["state"])
    for name, value in values.items():
        if name.startswith(STATE) and not is_tensor_value(value):
            fqn, key = name[len(STATE):].rsplit("/", 1)
            osd["state"][originals[fqn]][key] = value
    if PARAM_GROUPS in values:
        _apply_groups(osd["param_groups"], values[PARAM_GROUPS],
                      [[canonical(p) for p in g["params"]] for g in osd["param_groups"]])


def _apply_groups(live: list[dict], saved: list[dict], live_names: list[list[str]]) -> None:
    """Give each live group the hyper-parameters its parameters were saved with. ``saved`` may hold
    the groups of several saved ranks (pipeline stages hold different parameters): a parameter is
    found by name wherever it was saved, so any change of layout restores every group."""
    settings: dict[str, dict] = {}
    for group in saved:
        for name in group.get("params", []):
            settings.setdefault(name, {k: v for k, v in group.items() if k != "params"})
    for i, (group, names) in enumerate(zip(live, live_names)):
        found = [settings.get(name) for name in names]
        unknown = [name for name, s in zip(names, found) if s is None]
        if unknown:
            raise MismatchError(f"optimizer param group {i}: parameter(s) {unknown[:5]} are in no saved param group",
                                key="optimizer/param_groups")
        if any(not _same(found[0], other) for other in found[1:]):
            raise MismatchError(f"optimizer param group {i} holds parameters that were saved in groups with "
                                "different hyper-parameters", key="optimizer/param_groups")
        if found:
            group.update(found[0])


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else
               (not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor) and x == y)
               for x, y in ((a[k], b[k]) for k in a))
