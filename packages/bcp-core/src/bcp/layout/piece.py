"""Pieces: the unit that saving reads from and loading writes into. A piece is a box of a named
tensor together with the local tensor holding exactly that box's elements (aliasing live memory,
so saving reads from it and loading writes into it without another copy)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from bcp.layout.box import Box


@dataclass(slots=True)
class Piece:
    """Box ``box`` of tensor ``name`` (``global_shape``, ``dtype``); ``tensor`` has the box's shape."""

    name: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    box: Box
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.tensor.element_size()


class NamedBox(Protocol):
    """Anything that names a box of a tensor: a ``Piece``, or a piece that is produced later."""

    name: str
    box: Box


def box_columns(pieces: Sequence[NamedBox], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """The pieces' box offsets and lengths as ``[len(pieces), ndim]`` int64 arrays, padded as the
    shard table pads boxes (offset 0, length 1) and cut to ``ndim`` columns."""
    zeros, ones = (0,) * ndim, (1,) * ndim
    offsets = np.array([(p.box.offsets + zeros)[:ndim] for p in pieces], dtype=np.int64)
    lengths = np.array([(p.box.lengths + ones)[:ndim] for p in pieces], dtype=np.int64)
    return offsets.reshape(len(pieces), ndim), lengths.reshape(len(pieces), ndim)


def pad_columns(columns: np.ndarray, ncols: int, fill: int) -> np.ndarray:
    """``[n, k]`` box columns widened to ``ncols`` (k <= ncols) with ``fill``, as the shard table pads
    boxes of tensors with fewer dimensions than its widest (offset 0, length 1)."""
    if columns.shape[1] == ncols:
        return columns
    out = np.full((columns.shape[0], ncols), fill, dtype=np.int64)
    out[:, :columns.shape[1]] = columns
    return out
