"""Exact coverage: do a tensor's boxes hold every element of its global shape exactly once?

The one check behind every place that must know it: the save planner (the ranks' distinct pieces),
the tools' writer, a load (the saved shards of each tensor it reads), ``verify`` and bcp-megatron's
flat buckets. Comparing volumes is not enough (an overlap can hide a gap of the same size), and
comparing boxes pairwise is quadratic.

Boxes that are runs of the tensor's row-major order (whole tensors, row blocks, the boxes that flat
FSDP/ZeRO shards are cut into) are checked as 1-D intervals: one sort of every such box of every
tensor, then one pass. A tensor with any other box (a column block of a ``Shard(1)`` layout, a TP
grid cell, a flat shard of one) is cut into slabs at every box boundary of its first dimension; each
slab's boxes, less that dimension, form a smaller tensor checked the same way. Everything is array
operations over all tensors at once, so the cost is about the number of boxes for the layouts that
parallel training produces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bcp.layout.box import Box, flat_range_to_boxes
from bcp.layout.piece import pad_columns

#: Element counts at or above this do not fit the int64 arithmetic of the check (nor any tensor).
MAX_NUMEL = 1 << 62

GAP = "held by no shard"
OVERLAP = "held by more than one shard"
OUTSIDE = "outside the tensor's global shape"
TOO_LARGE = "in a global shape too large to address"


@dataclass(frozen=True, slots=True)
class CoverProblem:
    """Why tensor number ``tensor`` is not covered exactly: the elements of ``box`` are ``kind``."""

    tensor: int
    kind: str
    box: Box

    def describe(self) -> str:
        return f"elements at offsets {list(self.box.offsets)} with lengths {list(self.box.lengths)} are {self.kind}"


def first_cover_problem(shapes: Sequence[tuple[int, ...]], tensor: np.ndarray, offsets: np.ndarray,
                        lengths: np.ndarray) -> CoverProblem | None:
    """The first tensor (lowest number) whose boxes do not cover it exactly, or None.

    ``shapes[t]`` is tensor ``t``'s global shape; box ``i`` belongs to tensor ``tensor[i]`` and is
    ``offsets[i]``/``lengths[i]``, int64 rows padded with offset 0 and length 1 beyond a tensor's
    dimensions (as the shard table stores them). Identical boxes count twice: pass replicas once.
    """
    for t, shape in enumerate(shapes):
        if any(s < 0 for s in shape) or math.prod(shape) >= MAX_NUMEL:
            return CoverProblem(t, TOO_LARGE, Box.whole(shape))
    ncols = max([offsets.shape[1], *(len(shape) for shape in shapes)])
    shape_rows = np.ones((len(shapes), ncols), dtype=np.int64)
    for t, shape in enumerate(shapes):
        shape_rows[t, :len(shape)] = shape
    found = _first_problem(shape_rows, np.asarray(tensor, dtype=np.int64), pad_columns(offsets, ncols, 0),
                           pad_columns(lengths, ncols, 1))
    if found is None:
        return None
    t, kind, box_offsets, box_lengths = found
    ndim = len(shapes[t])
    return CoverProblem(t, kind, Box(tuple(box_offsets[:ndim]), tuple(box_lengths[:ndim])))


_Found = tuple[int, str, list[int], list[int]]  # tensor, kind, box offsets, box lengths (all columns)


def _first_problem(shape_rows: np.ndarray, tensor: np.ndarray, offsets: np.ndarray,
                   lengths: np.ndarray) -> _Found | None:
    limit = shape_rows[tensor]
    outside = np.any((offsets < 0) | (offsets > limit) | (lengths < 0) | (lengths > limit - offsets), axis=1)
    if np.any(outside):
        row = int(np.flatnonzero(outside)[0])
        return int(tensor[row]), OUTSIDE, offsets[row].tolist(), lengths[row].tolist()
    keep = np.all(lengths > 0, axis=1)  # an empty box holds nothing
    tensor, offsets, lengths = tensor[keep], offsets[keep], lengths[keep]
    irregular = np.zeros(len(shape_rows), dtype=bool)
    irregular[tensor[~_is_run(lengths, shape_rows[tensor])]] = True
    on_slabs = irregular[tensor]
    found = [_first_run_problem(shape_rows, irregular, tensor[~on_slabs], offsets[~on_slabs], lengths[~on_slabs]),
             _first_slab_problem(shape_rows, irregular, tensor[on_slabs], offsets[on_slabs], lengths[on_slabs])]
    return min((f for f in found if f is not None), key=lambda f: f[0], default=None)


def _is_run(lengths: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """Whether each box is one run of its tensor's row-major order: every dimension after the first
    one longer than 1 is whole."""
    ncols = lengths.shape[1]
    if ncols == 0:
        return np.ones(len(lengths), dtype=bool)
    longer = lengths > 1
    first = np.where(longer.any(axis=1), np.argmax(longer, axis=1), ncols - 1)
    whole_from = np.flip(np.cumprod(np.flip(lengths == shape, axis=1), axis=1), axis=1)  # dims j.. all whole
    whole_after = np.concatenate([whole_from[:, 1:], np.ones((len(lengths), 1), dtype=whole_from.dtype)], axis=1)
    return whole_after[np.arange(len(lengths)), first].astype(bool)


def _first_run_problem(shape_rows: np.ndarray, skipped: np.ndarray, tensor: np.ndarray, offsets: np.ndarray,
                       lengths: np.ndarray) -> _Found | None:
    """Tensors (those not ``skipped``) whose boxes are all row-major runs, as 1-D intervals: sorted
    by start, each must begin where the previous ended, the first at 0, the last end at the count."""
    ncols = shape_rows.shape[1]
    strides = np.ones_like(shape_rows)
    if ncols > 1:
        strides[:, :-1] = np.flip(np.cumprod(np.flip(shape_rows[:, 1:], axis=1), axis=1), axis=1)
    numel = np.prod(shape_rows, axis=1)
    start = np.sum(offsets * strides[tensor], axis=1)
    end = start + np.prod(lengths, axis=1)
    order = np.lexsort((start, tensor))
    tensor, start, end = tensor[order], start[order], end[order]
    first_of_tensor = np.ones(len(tensor), dtype=bool)
    first_of_tensor[1:] = tensor[1:] != tensor[:-1]
    expected = np.where(first_of_tensor, 0, np.concatenate([[0], end[:-1]]))
    problems: list[tuple[int, int, int, str]] = []  # tensor, flat start, flat end, kind
    wrong = np.flatnonzero(start != expected)
    if len(wrong):
        i = int(wrong[0])
        if start[i] > expected[i]:
            problems.append((int(tensor[i]), int(expected[i]), int(start[i]), GAP))
        else:
            problems.append((int(tensor[i]), int(start[i]), int(min(expected[i], end[i])), OVERLAP))
    last_of_tensor = np.ones(len(tensor), dtype=bool)
    last_of_tensor[:-1] = tensor[1:] != tensor[:-1]
    reached = np.zeros(len(shape_rows), dtype=np.int64)
    reached[tensor[last_of_tensor]] = end[last_of_tensor]
    short = np.flatnonzero(~skipped & (reached != numel))
    if len(short):
        t = int(short[0])
        problems.append((t, int(reached[t]), int(numel[t]), GAP))
    if not problems:
        return None
    t, low, high, kind = min(problems)
    box = flat_range_to_boxes(tuple(shape_rows[t].tolist()), low, high - low)[0][0]  # its first part
    return t, kind, list(box.offsets), list(box.lengths)


def _first_slab_problem(shape_rows: np.ndarray, chosen: np.ndarray, tensor: np.ndarray, offsets: np.ndarray,
                        lengths: np.ndarray) -> _Found | None:
    """The ``chosen`` tensors, cut at every box boundary of their first dimension: each slab is a
    tensor of the remaining dimensions holding the slab's part of every box that crosses it."""
    parents = np.flatnonzero(chosen)
    if len(parents) == 0:
        return None
    nbox = len(tensor)
    # Every cut point of every tensor: its box starts and ends, 0 and its first dimension's size.
    point_tensor = np.concatenate([tensor, tensor, parents, parents])
    point_at = np.concatenate([offsets[:, 0], offsets[:, 0] + lengths[:, 0], np.zeros(len(parents), dtype=np.int64),
                               shape_rows[parents, 0]])
    order = np.lexsort((point_at, point_tensor))
    distinct = np.ones(len(order), dtype=bool)
    distinct[1:] = (point_tensor[order][1:] != point_tensor[order][:-1]) | (point_at[order][1:] != point_at[order][:-1])
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.cumsum(distinct) - 1
    cut_tensor, cut_at = point_tensor[order][distinct], point_at[order][distinct]
    # Slab c lies between cuts c and c + 1 of one tensor.
    is_slab = np.zeros(len(cut_tensor), dtype=bool)
    is_slab[:-1] = cut_tensor[1:] == cut_tensor[:-1]
    slab_id = np.cumsum(is_slab) - 1
    slab_cut = np.flatnonzero(is_slab)
    first_slab, end_slab = rank[:nbox], rank[nbox:2 * nbox]  # a box spans slabs [first, end) by cut index
    spans = end_slab - first_slab
    box = np.repeat(np.arange(nbox), spans)
    cut = first_slab[box] + np.arange(len(box)) - np.repeat(np.cumsum(spans) - spans, spans)
    found = _first_problem(shape_rows[cut_tensor[slab_cut], 1:], slab_id[cut], offsets[box, 1:], lengths[box, 1:])
    if found is None:
        return None
    slab, kind, inner_offsets, inner_lengths = found
    c = slab_cut[slab]
    low, high = int(cut_at[c]), int(cut_at[c + 1])
    return int(cut_tensor[c]), kind, [low, *inner_offsets], [high - low, *inner_lengths]
