"""Finding the parts of a state: the nested mappings and lists a user hands ``save``/``load``.

The state is walked from the top. What is found at a path ``a/b/c`` (keys joined by ``/``, list
items by their index):

- an ``nn.Module``, or a list of modules (pipeline model parts, their names merged): a *module*
  component, read through its adapter (detected per module);
- a ``torch.optim.Optimizer`` (or :class:`PairedOptimizer`), or a list of them: an *optimizer*
  component, named by the parameter names of the module that owns its parameters;
- at the top-level ``model``/``optimizer`` keys, a state dict (a mapping with no module, optimizer
  or stateful object inside): the same components as given state dicts (the adapters' own input);
- a DTensor or a ``TensorShard``/``FlatShard`` (list): a *tensor*, resharded like a model's;
- any other tensor: a *plain tensor* (``planning.plain_tensors``), loaded in place;
- a ``DataloaderState`` under the top-level ``dataloader`` key;
- an object with ``state_dict``/``load_state_dict``: its state dict, walked in turn;
- a mapping or list holding any of the above: walked;
- anything else: a *per-rank value*, the rank's own, under its path (the tensors it holds are
  saved as tensors of their own, ``layout.values``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from bcp.adapters.dataloader import COMPONENT as DATALOADER
from bcp.adapters.dataloader import DataloaderState
from bcp.errors import CheckpointError
from bcp.layout.shards import FlatShard, TensorShard, is_dtensor

MODEL = "model"
OPTIMIZER = "optimizer"
#: Top-level keys whose mappings are state dicts handed to the adapters as they are.
STATE_DICT_KEYS = (MODEL, OPTIMIZER)


@dataclass(frozen=True)
class PairedOptimizer:
    """An optimizer with the module whose parameters it updates: needed only where several modules
    of the state hold all of its parameters (a module and one of its submodules, both saved)."""

    optimizer: torch.optim.Optimizer
    module: nn.Module


@dataclass(slots=True)
class ModuleComponent:
    path: str
    #: The module, a state dict, or the parts of a list of pipeline model parts.
    parts: list[Any]


@dataclass(slots=True)
class OptimizerComponent:
    path: str
    #: The optimizers (several for a list of them), or one optimizer state dict.
    items: list[Any]
    #: The module each optimizer was explicitly paired with (None: found by parameter identity).
    explicit: list[Any]


@dataclass(slots=True)
class Leaf:
    """A tensor or per-rank value at ``path``: ``container[key]`` in the state."""

    path: str
    container: Any
    key: Any


@dataclass(slots=True)
class Stateful:
    """An object with ``state_dict``/``load_state_dict``: its state dict ``tree`` is either walked
    (``walked``: ``load_state_dict(tree)`` once its leaves are loaded) or the per-rank value at ``path``."""

    path: str
    obj: Any
    tree: Any
    walked: bool


@dataclass(slots=True)
class StateParts:
    modules: list[ModuleComponent] = field(default_factory=list)
    optimizers: list[OptimizerComponent] = field(default_factory=list)
    tensors: list[Leaf] = field(default_factory=list)
    plain: list[Leaf] = field(default_factory=list)
    values: list[Leaf] = field(default_factory=list)
    statefuls: list[Stateful] = field(default_factory=list)
    dataloader: DataloaderState | None = None


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def walk(state: Mapping[str, Any]) -> StateParts:
    """The parts of ``state`` (see the module docstring)."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state must be a dict of components, got {type(state).__name__}")
    parts = StateParts()
    _walk_container(parts, "", state)
    return parts


def _walk_container(parts: StateParts, prefix: str, container: Any) -> None:
    items = container.items() if isinstance(container, Mapping) else enumerate(container)
    for key, value in items:
        if isinstance(container, Mapping) and (not isinstance(key, str) or not key or "/" in key):
            where = f" in {prefix!r}" if prefix else ""
            raise CheckpointError(f"state keys must be non-empty strings without '/': {key!r}{where}")
        _visit(parts, f"{prefix}/{key}" if prefix else str(key), value, container, key)


def _visit(parts: StateParts, path: str, value: Any, container: Any, key: Any) -> None:
    top = "/" not in path
    if isinstance(value, DataloaderState):
        if path != DATALOADER:
            raise CheckpointError(f"a DataloaderState belongs under the {DATALOADER!r} key, not {path!r} (a top-level key of the state)")
        parts.dataloader = value
    elif _is_module(value) or _is_list_of(value, _is_module):
        parts.modules.append(ModuleComponent(path, list(value) if isinstance(value, list) else [value]))
    elif _is_optimizer(value) or _is_list_of(value, _is_optimizer):
        items = list(value) if isinstance(value, list) else [value]
        parts.optimizers.append(OptimizerComponent(
            path, [i.optimizer if isinstance(i, PairedOptimizer) else i for i in items],
            [i.module if isinstance(i, PairedOptimizer) else None for i in items]))
    elif top and path in STATE_DICT_KEYS and isinstance(value, Mapping) and not _holds_parts(value, tensors=False):
        if path == MODEL:
            parts.modules.append(ModuleComponent(path, [value]))
        else:
            parts.optimizers.append(OptimizerComponent(path, [value], [None]))
    elif _is_sharded_tensor(value):
        parts.tensors.append(Leaf(path, container, key))
    elif isinstance(value, torch.Tensor):
        parts.plain.append(Leaf(path, container, key))
    elif is_stateful(value) and not isinstance(value, torch.Tensor):
        tree = value.state_dict()
        walked = _holds_parts(tree)
        parts.statefuls.append(Stateful(path, value, tree, walked))
        if walked:
            _walk_container(parts, path, tree)
    elif isinstance(value, (Mapping, list)) and _holds_parts(value):
        _walk_container(parts, path, value)
    else:
        parts.values.append(Leaf(path, container, key))


def _is_module(value: Any) -> bool:
    return isinstance(value, nn.Module)


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, (torch.optim.Optimizer, PairedOptimizer))


def _is_list_of(value: Any, kind: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(kind(item) for item in value)


def _is_sharded_tensor(value: Any) -> bool:
    if isinstance(value, list) and value:
        return all(isinstance(v, (TensorShard, FlatShard)) for v in value)
    return isinstance(value, (TensorShard, FlatShard)) or is_dtensor(value)


def _holds_parts(value: Any, tensors: bool = True) -> bool:
    """Whether ``value`` holds anything other than per-rank data (so it is walked, not encoded);
    without ``tensors``, anything other than per-rank data and sharded tensors (a state dict)."""
    if _is_module(value) or _is_optimizer(value) or isinstance(value, DataloaderState):
        return True
    if _is_sharded_tensor(value):
        return tensors
    if isinstance(value, torch.Tensor):
        return False
    if isinstance(value, Mapping):
        return any(_holds_parts(v, tensors) for v in value.values())
    if isinstance(value, list):
        return any(_holds_parts(v, tensors) for v in value)
    return is_stateful(value)
