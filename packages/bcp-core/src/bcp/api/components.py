"""The components of a ``state`` dict and how each is saved and restored.

``model`` and ``optimizer`` go through the framework adapter and are resharded; ``dataloader``
holding a :class:`DataloaderState` is saved as replicated and sharded parts and redistributed when
the DP size changes; every other key is a per-rank value (an object with
``state_dict``/``load_state_dict``, or a plain value).
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

import torch

from bcp.adapters.base import FrameworkAdapter
from bcp.adapters.dataloader import COMPONENT as DATALOADER
from bcp.adapters.dataloader import DataloaderState
from bcp.errors import CheckpointError, MismatchError

MODEL = "model"
OPTIMIZER = "optimizer"
RESHARDED = (MODEL, OPTIMIZER)
#: Per-rank values whose records from every saved rank are loaded together (the adapter resolves
#: them by parameter name): which parameters a rank holds changes with the layout (pipeline stages).
MERGED_ACROSS_RANKS = (f"{OPTIMIZER}/param_groups",)
#: The value of a name a load leaves unread (a dataloader part another DP rank receives).
SKIP = object()


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def check_keys(state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state must be a dict of components, got {type(state).__name__}")
    for key in state:
        if not isinstance(key, str) or not key or "/" in key:
            raise CheckpointError(f"component names must be non-empty strings without '/': {key!r}")


def is_per_rank(name: str) -> bool:
    """Whether the value ``name`` is one rank's own (not resharded, not a dataloader part; a plain
    ``dataloader`` value is one rank's own)."""
    return name.split("/", 1)[0] not in RESHARDED and not name.startswith(f"{DATALOADER}/")


def collect(state: Mapping[str, Any], adapter: FrameworkAdapter | None, *, for_load: bool,
            saved: Collection[str] = (), path: str | None = None) -> dict[str, Any]:
    """Every value to save or fill, by full name: ``model/<fqn>``, ``optimizer/<name>``,
    ``dataloader/<part>`` and one entry per other component. A load passes the ``saved`` value
    names: every saved dataloader part is named, with :data:`SKIP` for those this rank does not read."""
    values: dict[str, Any] = {}
    model = state.get(MODEL)
    if MODEL in state:
        values.update({f"{MODEL}/{k}": v for k, v in adapter.model_state(model).items()})
    if OPTIMIZER in state:
        optimizer_values = adapter.optimizer_state(model, state[OPTIMIZER], for_load=for_load)
        values.update({f"{OPTIMIZER}/{k}": v for k, v in optimizer_values.items()})
    for key, obj in state.items():
        if isinstance(obj, DataloaderState):
            values.update(_dataloader_values(key, obj, for_load, saved, path))
        elif key not in RESHARDED:
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


def _dataloader_values(key: str, loader: DataloaderState, for_load: bool, saved: Collection[str],
                       path: str | None) -> dict[str, Any]:
    if key != DATALOADER:
        raise CheckpointError(f"a DataloaderState belongs under the {DATALOADER!r} key, not {key!r}")
    if not for_load:
        return {f"{key}/{name}": value for name, value in loader.saved_values().items()}
    prefix = f"{key}/"
    names = [name[len(prefix):] for name in saved if name.startswith(prefix)]
    return {prefix + name: loader if read else SKIP for name, read in loader.wanted(names, path).items()}


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
        if isinstance(state[key], DataloaderState) and key in by_component:
            state[key].restore(by_component[key])
        if key in RESHARDED or key not in loaded:
            continue
        if is_stateful(state[key]):
            state[key].load_state_dict(loaded[key])
        else:
            state[key] = loaded[key]
