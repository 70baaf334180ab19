"""Tensor indices (``3``, ``1:5``, ``::2``, ``...``) as boxes to read: only the box is read, and
the index is then applied to it."""

from __future__ import annotations

import operator
from typing import Any, Sequence

from bcp.layout.box import Box


def box_for_index(index: Any, shape: Sequence[int]) -> tuple[Box, tuple[Any, ...]]:
    """The smallest box holding ``tensor[index]``, and the index that takes the result from it."""
    items = _expand(index if isinstance(index, tuple) else (index,), len(shape))
    offsets, lengths, within = [], [], []
    for dim, (item, size) in enumerate(zip(items, shape)):
        if isinstance(item, slice):
            start, stop, step = item.indices(size)
            if step < 1:
                raise IndexError(f"dimension {dim}: only positive slice steps are supported, got {step}")
            count = len(range(start, stop, step))
            offsets.append(start if count else 0)
            lengths.append((count - 1) * step + 1 if count else 0)
            within.append(slice(None, None, step))
        else:
            position = _integer(item, dim)
            if not -size <= position < size:
                raise IndexError(f"index {position} is out of bounds for dimension {dim} with size {size}")
            offsets.append(position % size)
            lengths.append(1)
            within.append(0)
    return Box(tuple(offsets), tuple(lengths)), tuple(within)


def _expand(items: tuple[Any, ...], ndim: int) -> tuple[Any, ...]:
    ellipses = sum(1 for item in items if item is Ellipsis)
    if ellipses > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if ellipses:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (ndim - len(items) + 1) + items[at + 1:]
    if len(items) > ndim:
        raise IndexError(f"too many indices for a tensor of {ndim} dimension(s)")
    return items + (slice(None),) * (ndim - len(items))


def _integer(item: Any, dim: int) -> int:
    if isinstance(item, bool):
        raise TypeError(f"dimension {dim}: boolean indices are not supported")
    try:
        return operator.index(item)
    except TypeError:
        raise TypeError(f"dimension {dim}: unsupported index {item!r}; use integers, slices and '...'") from None
