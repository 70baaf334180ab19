"""A Lightning checkpoint dict as bcp components, and back.

Lightning's dict holds the model's state dict under ``state_dict``, one state dict per optimizer
under ``optimizer_states`` and everything else (epoch, global step, loops, callbacks, schedulers,
precision plugin, datamodule, hyper-parameters, user additions) as plain values. In bcp they are:

- ``model``: the state dict, resharding-ready (tensors, DTensors, FSDP1's ``bcp.FlatShard``s);
- ``optimizer``: the optimizers' state keyed by parameter FQN, merged into one (no parameter is in
  two optimizers). Only FQN-keyed dicts can be resharded, and bcp_lightning's strategies give
  those; ``optimizer.state_dict()`` under Lightning's own single-device and DDP strategies is keyed
  by parameter index, cannot be named, and stays in ``lightning``;
- ``lightning``: every other entry, saved per rank;
- ``lightning_layout``: what rebuilding the dict without live objects takes: the state dict's
  original keys in order (bcp stores canonical names, without wrapper prefixes) with each tensor's
  dtype and global shape, the optimizers' groups and state entries.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

import bcp

MODEL = "model"
OPTIMIZER = "optimizer"
REST = "lightning"
LAYOUT = "lightning_layout"
STATE_DICT = "state_dict"
OPTIMIZER_STATES = "optimizer_states"
LAYOUT_VERSION = 1


def split(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The bcp components of a Lightning checkpoint dict (tensors are not copied)."""
    rest = dict(checkpoint)
    components: dict[str, Any] = {}
    layout: dict[str, Any] = {"version": LAYOUT_VERSION}
    if isinstance(rest.get(STATE_DICT), Mapping):
        components[MODEL] = model_view(rest.pop(STATE_DICT))
        layout[STATE_DICT] = [[key, *(tensor_description(v) or ())] for key, v in components[MODEL].items()]
    if is_fqn_keyed(rest.get(OPTIMIZER_STATES)):
        optimizer_states = rest.pop(OPTIMIZER_STATES)
        components[OPTIMIZER] = optimizer_view(optimizer_states)
        layout[OPTIMIZER_STATES] = _describe_optimizers(optimizer_states, components[OPTIMIZER])
    components[REST] = rest
    components[LAYOUT] = layout
    return components


def check_layout(layout: Any, path: str) -> None:
    """Refuse a layout record this version cannot read."""
    if not isinstance(layout, Mapping) or layout.get("version") != LAYOUT_VERSION:
        version = layout.get("version") if isinstance(layout, Mapping) else None
        raise bcp.FormatVersionError(f"Lightning layout record version {version!r}; this bcp_lightning reads "
                                     f"version {LAYOUT_VERSION}", path=path)


def is_fqn_keyed(optimizer_states: Any) -> bool:
    """Whether Lightning's ``optimizer_states`` name parameters by FQN (so bcp can reshard them)."""
    if not isinstance(optimizer_states, list) or not optimizer_states:
        return False
    for osd in optimizer_states:
        if not isinstance(osd, Mapping) or not isinstance(osd.get("state"), Mapping):
            return False
        groups = osd.get("param_groups")
        if not isinstance(groups, list) or not all(isinstance(p, str) for g in groups for p in g.get("params", ())):
            return False
        if not all(isinstance(k, str) for k in osd["state"]):
            return False
    return True


def model_view(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict as bcp reads and fills it (same keys and tensors)."""
    return dict(state_dict)


def optimizer_view(optimizer_states: list[Mapping[str, Any]]) -> dict[str, Any]:
    """FQN-keyed optimizer states merged into one, as bcp reads and fills it. The param groups are
    the originals, so hyper-parameters bcp loads land in them."""
    state: dict[str, Any] = {}
    groups: list[dict] = []
    owner: dict[str, int] = {}
    for index, osd in enumerate(optimizer_states):
        for group in osd["param_groups"]:
            for fqn in group["params"]:
                if owner.setdefault(fqn, index) != index:
                    raise bcp.CheckpointError(
                        f"parameter {fqn!r} is in optimizers {owner[fqn]} and {index}; bcp_lightning saves "
                        "optimizers whose parameters are disjoint")
        groups.extend(osd["param_groups"])
        state.update({fqn: dict(per_param)
                      for fqn, per_param in osd["state"].items()})
    return {"state": state, "param_groups": groups}


def write_back(state_dict: dict[str, Any], view: dict[str, Any]) -> None:
    """After a load into ``view``: give ``state_dict`` the values bcp replaced (non-tensor entries;
    tensors were filled in place, so they are the same objects)."""
    state_dict.update(view)


def write_back_optimizers(optimizer_states: list[dict[str, Any]], view: dict[str, Any]) -> None:
    """After a load into ``view``: each optimizer state dict holds the loaded state and no other,
    as ``Optimizer.load_state_dict`` gives it: a parameter the checkpoint holds no state for loses
    its entry, one saved with state (an empty entry included) has the loaded entry."""
    for osd in optimizer_states:
        params = {fqn for group in osd["param_groups"] for fqn in group["params"]}
        for fqn in [fqn for fqn in osd["state"] if fqn not in view["state"]]:
            del osd["state"][fqn]
        for fqn in params & view["state"].keys():
            osd["state"][fqn] = view["state"][fqn]


def templates(layout: Mapping[str, Any]) -> dict[str, Any]:
    """Fresh CPU values to load a checkpoint into when there are no live objects: whole tensors."""
    components: dict[str, Any] = {}
    if STATE_DICT in layout:
        components[MODEL] = {row[0]: _empty(*row[1:]) if len(row) == 3 else None for row in layout[STATE_DICT]}
    if OPTIMIZER_STATES in layout:
        described = layout[OPTIMIZER_STATES]
        state: dict[str, dict[str, Any]] = {}
        for row in described["state"]:
            state.setdefault(row[0], {})[row[1]] = _empty(*row[2:]) if len(row) == 4 else None
        groups = [{"params": list(params)} for params in described["group_params"]]
        components[OPTIMIZER] = {"state": state, "param_groups": groups}
    return components


def join(rest: Mapping[str, Any], layout: Mapping[str, Any], loaded: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict from loaded ``templates``: the state dict in its saved key order
    and the optimizer states keyed by parameter index, as ``optimizer.load_state_dict`` takes them."""
    checkpoint = dict(rest)
    if MODEL in loaded:
        checkpoint[STATE_DICT] = {row[0]: loaded[MODEL][row[0]] for row in layout[STATE_DICT]}
    if OPTIMIZER in loaded:
        checkpoint[OPTIMIZER_STATES] = _index_keyed(loaded[OPTIMIZER], layout[OPTIMIZER_STATES]["groups_per_optimizer"])
    return checkpoint


def _describe_optimizers(optimizer_states: list[Mapping[str, Any]], view: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "groups_per_optimizer": [len(osd["param_groups"]) for osd in optimizer_states],
        "group_params": [list(group["params"]) for group in view["param_groups"]],
        "state": [[fqn, key, *(tensor_description(v) or ())]
                  for fqn, per_param in view["state"].items() for key, v in per_param.items()],
    }


def _index_keyed(merged: Mapping[str, Any], groups_per_optimizer: list[int]) -> list[dict[str, Any]]:
    """Split merged FQN-keyed state back per optimizer, numbering parameters in group order as
    ``torch.optim.Optimizer.state_dict()`` does."""
    out = []
    start = 0
    for count in groups_per_optimizer:
        index: dict[str, int] = {}
        groups = []
        for group in merged["param_groups"][start:start + count]:
            ids = [index.setdefault(fqn, len(index)) for fqn in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        start += count
        state = {index[fqn]: per_param for fqn, per_param in merged["state"].items() if fqn in index}
        out.append({"state": state, "param_groups": groups})
    return out


def tensor_description(value: Any) -> tuple[torch.dtype, list[int]] | None:
    """dtype and global shape of a state-dict tensor value; None for other values."""
    if isinstance(value, bcp.FlatShard):
        return value.tensor.dtype, list(value.global_shape)
    if isinstance(value, torch.Tensor):  # DTensors report their global shape
        return value.dtype, list(value.shape)
    return None


def _empty(dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)
