"""Loaded values put back where the live state holds them, in place.

A load restores a value into the objects the live state already has, as it does a module's
tensors: whoever keeps a reference to a dict of tensors (an EMA, running statistics, a buffer dict)
sees the saved values after the load. A live tensor takes the loaded values into its own memory
(same dtype and shape); a live dict or list takes the loaded items (keys and length as loaded,
item by item in place); a live tuple is rebuilt around its items (its type kept: namedtuples stay
namedtuples). Where the live state holds nothing to put the value into, the loaded value is placed.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from bcp.api.undo import Undo
from bcp.layout.shards import is_dtensor

_NOTHING = object()


def into_live(live: Any, loaded: Any, undo: Undo | None = None) -> Any:
    """What to put where ``live`` is: ``live`` itself, now holding ``loaded``, where it can; else
    ``loaded``. ``undo`` records how to give what changed in place its previous contents back (a
    tensor copied into costs a copy of its previous bytes)."""
    if loaded is live:
        return live
    if isinstance(live, torch.Tensor) and isinstance(loaded, torch.Tensor):
        return _into_tensor(live, loaded, undo)
    if isinstance(live, dict) and isinstance(loaded, dict):
        items = [(key, into_live(live.get(key, _NOTHING), value, undo)) for key, value in loaded.items()]
        if undo is not None:
            undo.on_contents(_refill_dict(live, list(live.items())))
        live.clear()
        live.update(items)
        return live
    if isinstance(live, list) and isinstance(loaded, list):
        items = [into_live(live[i] if i < len(live) else _NOTHING, value, undo) for i, value in enumerate(loaded)]
        if undo is not None:
            undo.on_contents(_refill_list(live, list(live)))
        live[:] = items
        return live
    if isinstance(live, tuple) and isinstance(loaded, tuple) and len(live) == len(loaded):
        items = [into_live(old, new, undo) for old, new in zip(live, loaded)]
        if all(item is old for item, old in zip(items, live)):
            return live
        return _rebuilt(live, items)
    return loaded


def plain_copy(value: Any) -> Any:
    """``value`` with every dict, list and tuple in it copied, and everything else (tensors
    included) shared: a state dict as it is now, whatever filling it in place does later."""
    if isinstance(value, dict):
        return {key: plain_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_copy(item) for item in value]
    if isinstance(value, tuple):
        return _rebuilt(value, [plain_copy(item) for item in value])
    return value


def _into_tensor(live: torch.Tensor, loaded: torch.Tensor, undo: Undo | None) -> torch.Tensor:
    if is_dtensor(live) or live.shape != loaded.shape or live.dtype != loaded.dtype:
        return loaded
    if undo is not None:
        undo.on_contents(_copy_back(live, live.detach().clone()))
    with torch.no_grad():
        live.copy_(loaded)
    return live


def _copy_back(live: torch.Tensor, previous: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        with torch.no_grad():
            live.copy_(previous)
    return step


def _refill_dict(live: dict, items: list[tuple[Any, Any]]) -> Callable[[], None]:
    def step() -> None:
        live.clear()
        live.update(items)
    return step


def _refill_list(live: list, items: list[Any]) -> Callable[[], None]:
    def step() -> None:
        live[:] = items
    return step


def _rebuilt(like: tuple, items: list[Any]) -> tuple:
    """A tuple of ``like``'s type holding ``items`` (a plain tuple where that type cannot be rebuilt)."""
    kind = type(like)
    if kind is tuple:
        return tuple(items)
    try:
        return kind._make(items) if hasattr(kind, "_make") else kind(items)
    except (TypeError, ValueError):
        return tuple(items)
