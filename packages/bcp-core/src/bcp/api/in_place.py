"""Loaded values put back where the live state holds them, in place.

A load restores a value into the objects the live state already has, as it does a module's
tensors: whoever keeps a reference to a dict of tensors (an EMA, running statistics, a buffer dict)
sees the saved values after the load. A live tensor takes the loaded values into its own memory
(same dtype and shape); a live dict or list takes the loaded items (keys and length as loaded,
item by item in place); a live tuple is rebuilt around its items (its type kept: namedtuples stay
namedtuples). Where the live state holds nothing to put the value into, the loaded value is placed.
"""

from __future__ import annotations

from typing import Any

import torch

from bcp.layout.shards import is_dtensor

_NOTHING = object()


def into_live(live: Any, loaded: Any) -> Any:
    """What to put where ``live`` is: ``live`` itself, now holding ``loaded``, where it can; else
    ``loaded``."""
    if loaded is live:
        return live
    if isinstance(live, torch.Tensor) and isinstance(loaded, torch.Tensor):
        return _into_tensor(live, loaded)
    if isinstance(live, dict) and isinstance(loaded, dict):
        items = [(key, into_live(live.get(key, _NOTHING), value)) for key, value in loaded.items()]
        live.clear()
        live.update(items)
        return live
    if isinstance(live, list) and isinstance(loaded, list):
        live[:] = [into_live(live[i] if i < len(live) else _NOTHING, value) for i, value in enumerate(loaded)]
        return live
    if isinstance(live, tuple) and isinstance(loaded, tuple) and len(live) == len(loaded):
        items = [into_live(old, new) for old, new in zip(live, loaded)]
        if all(item is old for item, old in zip(items, live)):
            return live
        return _rebuilt(live, items)
    return loaded


def _into_tensor(live: torch.Tensor, loaded: torch.Tensor) -> torch.Tensor:
    if is_dtensor(live) or live.shape != loaded.shape or live.dtype != loaded.dtype:
        return loaded
    with torch.no_grad():
        live.copy_(loaded)
    return live


def _rebuilt(like: tuple, items: list[Any]) -> tuple:
    """A tuple of ``like``'s type holding ``items`` (a plain tuple where that type cannot be rebuilt)."""
    kind = type(like)
    if kind is tuple:
        return tuple(items)
    try:
        return kind._make(items) if hasattr(kind, "_make") else kind(items)
    except (TypeError, ValueError):
        return tuple(items)
