"""Optimizer state keyed by parameter FQN, for ``torch.optim.Optimizer`` objects and for the
FQN-keyed dicts of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``.

Names: ``state/<param fqn>/<state key>`` for per-parameter state (tensors follow the parameter's
sharding), ``param_groups`` for the groups' hyper-parameters with parameters listed by FQN, and
``empty_state`` for the parameters whose state is an entry with no key (saved only where there is one).

A load gives the optimizer what ``torch.optim.Optimizer.load_state_dict`` gives: the saved state
replaces the live one, entry for entry. A parameter the checkpoint holds no state for has none; one
saved with an empty entry has an empty entry; every saved key is restored, ``None`` and other plain
values included, saved tensors the live state lacks in new tensors placed as torch places them; the
param groups hold the saved hyper-parameters and no others. A live key the checkpoint lacks for a
parameter whose state it holds is missing, as any wanted tensor (``strict`` refuses it).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any, Callable, Collection, Mapping

import torch

from bcp.adapters.fqn import canonical, canonical_map
from bcp.errors import AdapterError, MismatchError
from bcp.layout.dtypes import dtype_from_name
from bcp.layout.shards import FlatShard, is_tensor_value

STATE = "state/"
PARAM_GROUPS = "param_groups"
EMPTY_STATE = "empty_state"
#: The values whose records from every saved rank load together: which parameters a rank holds
#: changes with the layout, and these name parameters.
MERGED = (PARAM_GROUPS, EMPTY_STATE)
_PARAMS = "params"
_PARAM_NAMES = "param_names"


def optimizer_values(model: Any, optimizer: Any, *, for_load: bool) -> dict[str, Any]:
    if isinstance(optimizer, Mapping):
        return _dict_values(optimizer, for_load=for_load)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise AdapterError(f"'optimizer' must be a torch.optim.Optimizer or an FQN-keyed state dict, "
                           f"got {type(optimizer).__name__}")
    names = _param_names(model)
    state = state_to_load_into(optimizer) if for_load else optimizer.state
    group_names = [_group_names(names, g[_PARAMS], i) for i, g in enumerate(optimizer.param_groups)]
    per_param = {fqn: state[param] for group, fqns in zip(optimizer.param_groups, group_names)
                 for param, fqn in zip(group[_PARAMS], fqns) if param in state}
    groups = [{**{k: v for k, v in g.items() if k != _PARAMS}, _PARAMS: fqns}
              for g, fqns in zip(optimizer.param_groups, group_names)]
    return _flat(per_param, groups, for_load=for_load)


def _flat(per_param: Mapping[str, Mapping[str, Any]], groups: list[dict], *, for_load: bool) -> dict[str, Any]:
    values = {f"{STATE}{fqn}/{key}": value for fqn, state in per_param.items() for key, value in state.items()}
    values[PARAM_GROUPS] = groups
    empty = [fqn for fqn, state in per_param.items() if not state]
    if empty or for_load:  # a load asks for it: the checkpoint may hold empty entries
        values[EMPTY_STATE] = empty
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
    return {"state": _per_param(values), "param_groups": values[PARAM_GROUPS]}


def flat_optimizer_values(osd: Mapping[str, Any]) -> dict[str, Any]:
    """The reverse of :func:`nested_optimizer_state`."""
    return _flat(osd["state"], osd["param_groups"], for_load=False)


def wanted_as_saved(values: dict[str, Any], prefix: str, saved_tensors: Mapping[str, Any] | None,
                    saved_objects: Collection[str]) -> dict[str, Any]:
    """The optimizer values a load wants, given the checkpoint's names (``prefix``: the
    component's, ending in ``/``): the state of the parameters the checkpoint holds state for, with
    every key saved for them. A saved tensor the live state lacks (or holds as a plain value) is
    read into a new CPU tensor, placed by :func:`apply_optimizer_values` as torch places it; a
    saved plain value is read whatever the live one is."""
    saved_tensors = saved_tensors or {}
    params = {fqn for group in values[PARAM_GROUPS] for fqn in group[_PARAMS]}
    saved = [name[len(prefix):] for names in (saved_tensors, saved_objects) for name in names
             if name.startswith(prefix + STATE) and _split(name[len(prefix):])[0] in params]
    with_state = {_split(name)[0] for name in saved}
    wanted = {name: value for name, value in values.items()
              if not name.startswith(STATE) or _split(name)[0] in with_state}
    for name in saved:
        entry = saved_tensors.get(prefix + name)
        if entry is not None and not is_tensor_value(wanted.get(name)):
            wanted[name] = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
        elif entry is None and prefix + name in saved_objects:
            wanted.setdefault(name, None)
    if prefix + EMPTY_STATE not in saved_objects:
        wanted.pop(EMPTY_STATE, None)
    return wanted


def apply_optimizer_values(model: Any, optimizer: Any, values: dict[str, Any]) -> None:
    """Replace the optimizer's state and hyper-parameters with the loaded ones (tensors were
    filled in place), as ``Optimizer.load_state_dict`` does."""
    if isinstance(optimizer, Mapping):
        _apply_to_dict(optimizer, values)
        return
    names = _param_names(model)
    replace_state(optimizer, [[names[id(p)] for p in g[_PARAMS]] for g in optimizer.param_groups],
                  _per_param(values), values.get(PARAM_GROUPS))


def replace_state(optimizer: torch.optim.Optimizer, names: list[list[str]], loaded: Mapping[str, Mapping[str, Any]],
                  saved_groups: list[dict] | None) -> None:
    """Give ``optimizer`` the loaded per-parameter state (by FQN; ``names`` lists each group's
    parameters' FQNs) and the hyper-parameters of ``saved_groups`` (groups listing parameters by
    FQN; None keeps the live ones), as ``Optimizer.load_state_dict`` does: a parameter without
    loaded state has none, tensors are placed as torch places them."""
    if saved_groups is not None:
        _apply_groups(optimizer.param_groups, saved_groups, names)
    # A new state, as load_state_dict makes: nothing of the live one stays, not even entries keyed
    # by tensors that are no longer parameters (L-BFGS keys its state by the parameters it was
    # built with, which FSDP2's preparation in accelerate replaces).
    state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    for group, fqns in zip(optimizer.param_groups, names):
        for param, fqn in zip(group[_PARAMS], fqns):
            if fqn in loaded:
                ordered = _in_live_order(loaded[fqn], optimizer.state.get(param, {}))
                state[param] = {key: placed(param, group, key, value) for key, value in ordered.items()}
    # As load_state_dict ends: the optimizer's own defaults for group keys an older save lacks.
    optimizer.__setstate__({"state": state, "param_groups": optimizer.param_groups})


def placed(param: torch.Tensor, group: Mapping[str, Any], key: str, value: Any) -> Any:
    """A loaded per-parameter value where ``Optimizer.load_state_dict`` puts it: floating-point
    tensors in the parameter's dtype, every tensor on its device, ``step`` as saved unless the group
    is fused or capturable (then float32 on the device)."""
    value = value.tensor if isinstance(value, FlatShard) else value
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        return value.to(device=param.device, dtype=torch.float32) if group.get("capturable") or group.get("fused") \
            else value
    return value.to(device=param.device, dtype=param.dtype) if param.is_floating_point() else value.to(param.device)


def initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter without state the state one step would create (:func:`created_state`),
    so a never-stepped optimizer has tensors to load into."""
    optimizer.state.update(created_state(optimizer))


def state_to_load_into(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, dict[str, Any]]:
    """Each parameter's state for a load to fill: its live state where it has some, else the state one
    step would create for it (:func:`created_state`). The live optimizer is not changed: a load
    that fails leaves it as it was, and one that succeeds replaces its state with what it loaded."""
    return {**optimizer.state, **created_state(optimizer)}


def created_state(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, dict[str, Any]]:
    """The state one step would create for the parameters that have none (keys, shapes, dtypes,
    devices and shardings as the optimizer makes them), without changing the optimizer: a stand-in
    with its settings and parameters but a state, param groups and step hooks of its own takes one
    step with zero gradients and a zero learning rate. Parameters do not change (every update is
    scaled by the learning rate); their gradients are set aside for the step and put back."""
    params = [p for g in optimizer.param_groups for p in g[_PARAMS]]
    missing = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if not missing:
        return {}
    stand_in = _stand_in(optimizer)
    missing_ids = {id(p) for p in missing}
    saved_grads = [p.grad for p in params]
    sparse = isinstance(optimizer, torch.optim.SparseAdam)  # it takes sparse gradients only
    try:
        for p in params:
            p.grad = (torch.zeros_like(p).to_sparse() if sparse else torch.zeros_like(p)) if id(p) in missing_ids \
                else None
        _step(stand_in)
    finally:
        for p, grad in zip(params, saved_grads):
            p.grad = grad
    return {p: stand_in.state[p] for p in missing if p in stand_in.state}


def _stand_in(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over its parameters, with its settings at a zero
    learning rate, an empty state and no step hooks, built as unpickling builds one; attributes its
    class adds (L-BFGS's parameter list) are shared, methods patched onto the instance (an LR
    scheduler's counting ``step``, bound to the live optimizer) are not."""
    stand_in = type(optimizer).__new__(type(optimizer))
    groups = [{**g, "lr": torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0}
              for g in optimizer.param_groups]
    stand_in.__setstate__({"defaults": dict(optimizer.defaults), "state": defaultdict(dict), "param_groups": groups})
    own = vars(stand_in)
    own.update({k: v for k, v in vars(optimizer).items() if k not in own and not callable(v)})
    return stand_in


def _step(optimizer: torch.optim.Optimizer) -> None:
    """One step; an optimizer whose step needs a closure (L-BFGS) gets one giving a zero loss."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        optimizer.step(lambda: torch.zeros(()))
    else:
        optimizer.step()


def _param_names(model: Any) -> dict[int, str]:
    if not isinstance(model, torch.nn.Module):
        raise AdapterError("an Optimizer object needs the model in state['model'] (an nn.Module) to name "
                           "its parameters; or pass an FQN-keyed optimizer state dict")
    return {id(p): canonical(n) for n, p in model.named_parameters()}


def _dict_values(osd: Mapping[str, Any], *, for_load: bool) -> dict[str, Any]:
    state = osd.get("state")
    groups = osd.get("param_groups")
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        raise AdapterError("an optimizer state dict needs 'state' (a dict) and 'param_groups' (a list)")
    if any(not isinstance(k, str) for k in state):
        raise AdapterError(
            "this optimizer state dict is keyed by parameter index (a raw optimizer.state_dict()), which "
            "cannot be resharded; pass the Optimizer object itself, or the FQN-keyed dict from "
            "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer)")
    per_param = {fqn: state[original] for fqn, original in canonical_map(state).items()}
    named = [{**{k: v for k, v in g.items() if k != _PARAMS}, _PARAMS: [canonical(p) for p in g[_PARAMS]]}
             for g in groups]
    return _flat(per_param, named, for_load=for_load)


def _per_param(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Loaded per-parameter state by FQN, parameters saved with an empty entry included."""
    state: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        if name.startswith(STATE):
            fqn, key = _split(name)
            state.setdefault(fqn, {})[key] = value
    for fqn in values.get(EMPTY_STATE, ()):
        state.setdefault(fqn, {})
    return state


def _in_live_order(loaded: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter's loaded state with its keys in the order the live optimizer created them (the
    order it saved them in), then any others by name."""
    return {key: loaded[key] for key in [*[k for k in live if k in loaded], *sorted(k for k in loaded if k not in live)]}


def _split(name: str) -> tuple[str, str]:
    """``state/<fqn>/<key>`` as ``(fqn, key)``."""
    fqn, key = name[len(STATE):].rsplit("/", 1)
    return fqn, key


def _apply_to_dict(osd: Any, values: dict[str, Any]) -> None:
    """The FQN-keyed dict's state replaced by the loaded one. Per-parameter dicts are kept and
    refilled (they may be the live optimizer's own); a parameter without loaded state leaves it
    emptied and removed, one the dict lacks is added under the name its param group gives it."""
    loaded = _per_param(values)
    originals = canonical_map([p for g in osd["param_groups"] for p in g[_PARAMS]])
    for original, fqn in [(o, canonical(o)) for o in osd["state"]]:
        if fqn not in loaded:
            osd["state"].pop(original).clear()
    for fqn, per_param in loaded.items():
        if fqn in originals:
            target = osd["state"].setdefault(originals[fqn], {})
            ordered = _in_live_order(per_param, target)
            target.clear()
            target.update({key: value.tensor if isinstance(value, FlatShard) else value
                           for key, value in ordered.items()})
    if PARAM_GROUPS in values:
        _apply_groups(osd["param_groups"], values[PARAM_GROUPS],
                      [[canonical(p) for p in g[_PARAMS]] for g in osd["param_groups"]])


def check_optimizer_values(model: Any, optimizer: Any, values: Mapping[str, Any]) -> None:
    """Raise the :class:`MismatchError` :func:`apply_optimizer_values` would raise for ``values``,
    changing nothing: the saved param groups must give every live group's parameters one set of
    hyper-parameters (:func:`_group_settings`)."""
    if PARAM_GROUPS not in values:
        return
    if isinstance(optimizer, Mapping):
        names = [[canonical(p) for p in g[_PARAMS]] for g in optimizer["param_groups"]]
    else:
        fqns = _param_names(model)
        names = [[fqns[id(p)] for p in g[_PARAMS]] for g in optimizer.param_groups]
    _group_settings(values[PARAM_GROUPS], names)


def kept_optimizer_state(optimizer: Any) -> Callable[[], None]:
    """How to give ``optimizer`` (a ``torch.optim.Optimizer`` or an FQN-keyed state dict) back the
    state and param groups it has now, after :func:`apply_optimizer_values` (which puts new state
    dicts in place and refills the groups); its tensors' bytes are the caller's to restore."""
    groups = optimizer["param_groups"] if isinstance(optimizer, Mapping) else optimizer.param_groups
    kept_groups = [dict(group) for group in groups]
    if isinstance(optimizer, Mapping):
        state = optimizer["state"]
        kept_state = {key: (entry, dict(entry)) for key, entry in state.items()}
    else:
        kept = optimizer.state

    def restore() -> None:
        for group, items in zip(groups, kept_groups):
            group.clear()
            group.update(items)
        if isinstance(optimizer, Mapping):
            state.clear()
            for key, (entry, items) in kept_state.items():
                entry.clear()
                entry.update(items)
                state[key] = entry
        else:
            optimizer.state = kept
    return restore


def _apply_groups(live: list[dict], saved: list[dict], live_names: list[list[str]]) -> None:
    """Give each live group the hyper-parameters its parameters were saved with, and no others (as
    ``load_state_dict`` replaces each group)."""
    for group, settings in zip(live, _group_settings(saved, live_names)):
        if settings is not None:
            replace_group_settings(group, settings)


def _group_settings(saved: list[dict], live_names: list[list[str]]) -> list[dict | None]:
    """Each live group's saved hyper-parameters (None for a group without parameters). ``saved``
    may hold the groups of several saved ranks (pipeline stages hold different parameters): a
    parameter is found by name wherever it was saved, so any change of layout restores every group.
    Refused as ``Optimizer.load_state_dict`` refuses groups of other sizes or number, by name: a live
    parameter in no saved group, or a live group whose parameters were saved with different
    hyper-parameters."""
    settings: dict[str, dict] = {}
    for group in saved:
        for name in group.get(_PARAMS, []):
            settings.setdefault(name, {k: v for k, v in group.items() if k != _PARAMS})
    chosen: list[dict | None] = []
    for i, names in enumerate(live_names):
        found = [settings.get(name) for name in names]
        unknown = [name for name, s in zip(names, found) if s is None]
        if unknown:
            raise MismatchError(f"optimizer param group {i}: parameter(s) {unknown[:5]} are in no saved param group",
                                key="optimizer/param_groups")
        if any(not _same(found[0], other) for other in found[1:]):
            raise MismatchError(f"optimizer param group {i} holds parameters that were saved in groups with "
                                "different hyper-parameters", key="optimizer/param_groups")
        chosen.append(found[0] if found else None)
    return chosen


def replace_group_settings(group: dict[str, Any], saved: Mapping[str, Any]) -> None:
    """``group`` with the saved hyper-parameters in place of its own, its parameters kept (and
    their names, where the saved group has none), in the key order ``load_state_dict`` leaves."""
    kept = {_PARAMS: group[_PARAMS]}
    if _PARAM_NAMES in group and _PARAM_NAMES not in saved:
        kept[_PARAM_NAMES] = group[_PARAM_NAMES]
    group.clear()
    group.update({k: v for k, v in saved.items() if k != _PARAMS})
    group.update(kept)


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else
               (not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor) and x == y)
               for x, y in ((a[k], b[k]) for k in a))
