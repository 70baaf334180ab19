"""Boxes: rectangular regions of a tensor's global shape, and the cutting of flat ranges into boxes.

A box is the unit of the representation: every saved piece and every requested piece is one box
(nD offsets + nD lengths) of a named tensor. A 0-d tensor has the single empty box ``Box((), ())``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence


@dataclass(frozen=True, slots=True)
class Box:
    """A region ``[offsets, offsets + lengths)`` of a tensor with global shape of ``len(offsets)`` dims."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @staticmethod
    def whole(shape: Sequence[int]) -> "Box":
        return Box((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.lengths)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def intersect(self, other: "Box") -> "Box | None":
        """The common region, or None when the boxes do not overlap (or one is empty)."""
        offsets, lengths = [], []
        for a0, an, b0, bn in zip(self.offsets, self.lengths, other.offsets, other.lengths):
            lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
            if hi <= lo:
                return None
            offsets.append(lo)
            lengths.append(hi - lo)
        if self.numel == 0 or other.numel == 0:
            return None
        return Box(tuple(offsets), tuple(lengths))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(
            o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(self.offsets, self.lengths, shape)
        )

    def relative_to(self, outer: "Box") -> "Box":
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.lengths)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths))


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def contiguous_span(inner: Box, outer_lengths: Sequence[int]) -> tuple[int, int]:
    """Element range ``[first, last + 1)`` that ``inner`` (relative coordinates) spans in a row-major
    array of shape ``outer_lengths``: the smallest contiguous run holding all of its elements."""
    if inner.numel == 0:
        return 0, 0
    strides = row_major_strides(outer_lengths)
    first = sum(o * s for o, s in zip(inner.offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(inner.offsets, inner.lengths, strides))
    return first, last + 1


def is_contiguous_in(inner: Box, outer_lengths: Sequence[int]) -> bool:
    """Whether ``inner`` (relative coordinates) occupies one unbroken run of a row-major array."""
    dims = list(zip(inner.lengths, outer_lengths))
    # Skip leading dims of length 1; after the first longer dim, every dim must be full.
    i = 0
    while i < len(dims) and dims[i][0] == 1:
        i += 1
    return all(n == full for n, full in dims[i + 1 :])


def flat_range_to_boxes(shape: Sequence[int], start: int, length: int) -> list[tuple[Box, int]]:
    """Cut the row-major flat range ``[start, start + length)`` of a tensor of ``shape`` into the
    fewest regular boxes (at most ``2 * ndim - 1``), each with its offset inside the flat range.

    Each box's own row-major order is the flat order, so its elements are one contiguous run of the
    flat range: ``flat[offset : offset + box.numel]`` viewed as ``box.lengths``.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if start < 0 or length < 0 or start + length > total:
        raise ValueError(f"flat range [{start}, {start + length}) is outside a tensor of shape {shape}")
    boxes: list[tuple[Box, int]] = []
    position = 0
    for box in _cut(shape, start, start + length):
        boxes.append((box, position))
        position += box.numel
    return boxes


def _cut(shape: tuple[int, ...], start: int, end: int) -> Iterator[Box]:
    if end <= start:
        return
    if not shape:
        yield Box((), ())
        return
    inner_shape = shape[1:]
    inner = math.prod(inner_shape)
    if inner == 0:
        return
    first, first_rem = divmod(start, inner)
    last, last_rem = divmod(end, inner)
    if first == last or (first + 1 == last and last_rem == 0 and first_rem != 0):
        # The range stays inside one slab of dim 0: cut inside it.
        for sub in _cut(inner_shape, first_rem, end - first * inner):
            yield Box((first,) + sub.offsets, (1,) + sub.lengths)
        return
    if first_rem:
        for sub in _cut(inner_shape, first_rem, inner):
            yield Box((first,) + sub.offsets, (1,) + sub.lengths)
        first += 1
    if last > first:
        yield Box((first,) + (0,) * len(inner_shape), (last - first,) + inner_shape)
    if last_rem:
        for sub in _cut(inner_shape, 0, last_rem):
            yield Box((last,) + sub.offsets, (1,) + sub.lengths)
