"""Boxes and the decomposition of flat ranges into boxes, checked against brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from bcp.layout.box import Box, contiguous_span, flat_range_to_boxes, is_contiguous_in


def elements(box: Box, shape: tuple[int, ...]) -> list[int]:
    """Flat indices of a box's elements, in the box's own row-major order."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    ranges = [range(o, o + n) for o, n in zip(box.offsets, box.lengths)]
    return [sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*ranges)]


def check_decomposition(shape: tuple[int, ...], start: int, length: int) -> None:
    boxes = flat_range_to_boxes(shape, start, length)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    covered: list[int] = []
    for box, at in boxes:
        assert box.within(shape) and box.numel > 0
        assert at == len(covered), "each box starts where the previous one ended in the flat piece"
        covered.extend(elements(box, shape))
    assert covered == list(range(start, start + length))


def test_random_flat_ranges_match_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        ndim = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 6) for _ in range(ndim))
        total = math.prod(shape)
        start = rng.randint(0, total)
        check_decomposition(shape, start, rng.randint(0, total - start))


@pytest.mark.parametrize("shape,start,length", [
    ((3, 2), 0, 3), ((3, 2), 3, 3),               # the paper's Fig. 11 example
    ((4, 5, 6), 0, 120), ((4, 5, 6), 7, 1),       # whole tensor, a single element
    ((4, 5, 6), 7, 0), ((4, 5, 6), 119, 1),       # empty, last element
    ((2, 3, 4, 5), 17, 83), ((7,), 2, 5), ((1, 1, 9), 3, 4),
])
def test_edge_ranges(shape, start, length):
    check_decomposition(shape, start, length)


def test_worst_case_uses_2ndim_minus_1_boxes():
    boxes = flat_range_to_boxes((4, 4, 4), 5, 54)  # (0,1,1) .. (3,2,2): partial row, rows, slabs, rows, partial row
    assert len(boxes) == 5


def test_zero_dim_tensor_and_out_of_range():
    assert flat_range_to_boxes((), 0, 1) == [(Box((), ()), 0)]
    with pytest.raises(ValueError):
        flat_range_to_boxes((2, 3), 4, 3)


def test_intersection_and_relative_coordinates():
    a, b = Box((0, 2), (4, 4)), Box((2, 0), (4, 3))
    assert a.intersect(b) == Box((2, 2), (2, 1))
    assert Box((0,), (2,)).intersect(Box((2,), (2,))) is None
    assert Box((0,), (0,)).intersect(Box((0,), (5,))) is None
    assert Box((), ()).intersect(Box((), ())) == Box((), ())
    assert Box((2, 2), (2, 1)).relative_to(a) == Box((2, 0), (2, 1))


def test_contiguity_and_span():
    outer = (4, 6)
    assert is_contiguous_in(Box((1, 0), (2, 6)), outer)
    assert is_contiguous_in(Box((1, 2), (1, 3)), outer)
    assert not is_contiguous_in(Box((1, 2), (2, 3)), outer)
    assert contiguous_span(Box((1, 2), (2, 3)), outer) == (8, 17)
    assert contiguous_span(Box((0, 0), (0, 6)), outer) == (0, 0)
