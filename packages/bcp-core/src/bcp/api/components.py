"""The components of a ``state`` dict and how each is saved and restored.

``model`` and ``optimizer`` go through the framework adapter and are resharded; every other key is
a per-rank value (an object with ``state_dict``/``load_state_dict``, or a plain value).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from bcp.adapters.base import FrameworkAdapter
from bcp.errors import CheckpointError, MismatchError

MODEL = "model"
OPTIMIZER = "optimizer"
RESHARDED = (MODEL, OPTIMIZER)
#: Per-rank values whose records from every saved rank are loaded together (the adapter resolves
#: them by parameter name): which parameters a rank holds changes with the layout (pipeline stages).
MERGED_ACROSS_RANKS = (f"{OPTIMIZER}/param_groups",)


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def check_keys(state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state must be a dict of components, got {type(state).__name__}")
    for key in state:
        if not isinstance(key, str) or not key or "/" in key:
            raise CheckpointError(f"component names must be non-empty strings without '/': {key!r}")


def collect(state: Mapping[str, Any], adapter: FrameworkAdapter | None, *, for_load: bool) -> dict[str, Any]:
    """Every value to save or fill, by full name: ``model/<fqn>``, ``optimizer/<name>``, and one
    entry per other component."""
    values: dict[str, Any] = {}
    model = state.get(MODEL)
    if MODEL in state:
        values.update({f"{MODEL}/{k}": v for k, v in adapter.model_state(model).items()})
    if OPTIMIZER in state:
        optimizer_values = adapter.optimizer_state(model, state[OPTIMIZER], for_load=for_load)
        values.update({f"{OPTIMIZER}/{k}": v for k, v in optimizer_values.items()})
    for key, obj in state.items():
        if key not in RESHARDED:
            values[key] = obj.state_dict() if is_stateful(obj) else obj
    if for_load:
        _check_not_meta(values)
    return values


def _check_not_meta(values: dict[str, Any]) -> None:
    """A tensor on the meta device has no memory: loading into it would read and drop every byte."""
    meta = [name for name, value in values.items() if any(t.is_meta for t in _tensors_of(value))]
    if meta:
        raise MismatchError(f"{len(meta)} live tensor(s) are on the meta device and cannot hold loaded values, "
                            f"e.g. {meta[:3]}; materialize the model first (e.g. model.to_empty(device=...))")


def _tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a state-dict value: itself, or the tensors of its shards."""
    if isinstance(value, torch.Tensor):
        return [value]
    shards = value if isinstance(value, (list, tuple)) else [value]
    return [s.tensor for s in shards if isinstance(getattr(s, "tensor", None), torch.Tensor)]


def apply(state: dict[str, Any], adapter: FrameworkAdapter | None, loaded: dict[str, Any]) -> None:
    """Give loaded values back to the live objects (tensors were already filled in place)."""
    model = state.get(MODEL)
    by_component: dict[str, dict[str, Any]] = {}
    for name, value in loaded.items():
        component, _, rest = name.partition("/")
        by_component.setdefault(component, {})[rest] = value
    if MODEL in by_component:
        adapter.load_model_state(model, by_component[MODEL])
    if OPTIMIZER in by_component:
        adapter.load_optimizer_state(model, state[OPTIMIZER], by_component[OPTIMIZER])
    for key in list(state):
        if key in RESHARDED or key not in loaded:
            continue
        if is_stateful(state[key]):
            state[key].load_state_dict(loaded[key])
        else:
            state[key] = loaded[key]
