"""Turning state-dict values into pieces: (tensor name, dtype, global shape, box, local view).

A piece's tensor has exactly the box's shape and aliases the live memory, so saving reads from it
and loading writes into it without another copy.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from bcp.errors import UnsupportedValueError
from bcp.layout.box import Box, flat_range_to_boxes
from bcp.layout.piece import Piece
from bcp.layout.shards import PLAIN_TENSORS, FlatShard, TensorShard, is_dtensor
from bcp.torch_internals.tensors import local_shape_and_global_offset


def tensor_meta(name: str, value: Any) -> tuple[torch.dtype, tuple[int, ...]]:
    """dtype and global shape of a tensor value, known even where this rank holds no piece of it."""
    if type(value) in PLAIN_TENSORS:
        return value.dtype, tuple(value.shape)
    first = value[0] if isinstance(value, (list, tuple)) else value
    if isinstance(first, (TensorShard, FlatShard)):
        shapes = {tuple(v.global_shape) for v in (value if isinstance(value, (list, tuple)) else [value])}
        dtypes = {v.tensor.dtype for v in (value if isinstance(value, (list, tuple)) else [value])}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise UnsupportedValueError(f"pieces disagree on global shape {shapes} or dtype {dtypes}", key=name)
        return dtypes.pop(), shapes.pop()
    if isinstance(first, torch.Tensor):
        return first.dtype, tuple(int(s) for s in first.shape)
    raise UnsupportedValueError(f"not a tensor value: {type(value).__name__}", key=name)


def pieces_of(name: str, value: Any) -> list[Piece]:
    """The pieces this rank holds of tensor ``name`` (an empty local shard gives no piece)."""
    if type(value) in PLAIN_TENSORS:
        return _whole(name, value)
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in pieces_of(name, v)]
    if isinstance(value, TensorShard):
        box = Box(tuple(value.offsets), tuple(value.tensor.shape))
        return _checked(name, value.tensor, tuple(value.global_shape), box)
    if isinstance(value, FlatShard):
        flat = value.tensor
        return [
            p
            for box, at in flat_range_to_boxes(value.global_shape, value.flat_offset, flat.numel())
            for p in _checked(name, flat[at: at + box.numel].view(box.lengths), tuple(value.global_shape), box)
        ]
    if is_dtensor(value):
        return _dtensor_pieces(name, value)
    if isinstance(value, torch.Tensor):
        return _whole(name, value)
    raise UnsupportedValueError(f"not a tensor value: {type(value).__name__}", key=name)


def _whole(name: str, value: torch.Tensor) -> list[Piece]:
    """A plain tensor is one piece covering all of it (its box needs no bounds check)."""
    if value.layout != torch.strided:
        raise UnsupportedValueError("sparse and non-strided tensors are not supported", key=name)
    shape = tuple(value.shape)
    if value.numel() == 0:
        return []
    return [Piece(name, value.dtype, shape, _whole_box(shape), value.detach())]


@functools.lru_cache(maxsize=4096)
def _whole_box(shape: tuple[int, ...]) -> Box:
    """Boxes are immutable, so tensors of one shape (a model's many layers) share one."""
    return Box((0,) * len(shape), shape)


def _checked(name: str, tensor: torch.Tensor, global_shape: tuple[int, ...], box: Box) -> list[Piece]:
    if not box.within(global_shape):
        raise UnsupportedValueError(f"local piece {box} lies outside the global shape {global_shape}", key=name)
    if tensor.layout != torch.strided:
        raise UnsupportedValueError("sparse and non-strided tensors are not supported", key=name)
    if box.numel == 0:
        return []
    return [Piece(name, tensor.dtype, tuple(int(s) for s in global_shape), box, tensor)]


def _dtensor_pieces(name: str, value: Any) -> list[Piece]:
    from torch.distributed.tensor import Partial

    if any(isinstance(p, Partial) for p in value.placements):
        raise UnsupportedValueError(
            f"DTensor with a Partial placement {value.placements}: reduce it (redistribute to "
            "Replicate or Shard) before saving", key=name)
    local = value.to_local().detach()
    if value.device_mesh.get_coordinate() is None:  # this rank is outside the DTensor's mesh
        return []
    shape, offsets = local_shape_and_global_offset(value)
    if tuple(shape) != tuple(local.shape):
        raise UnsupportedValueError(
            f"DTensor local shape {tuple(local.shape)} does not match its placements {value.placements} "
            f"(expected {tuple(shape)})", key=name)
    return _checked(name, local, tuple(value.shape), Box(tuple(offsets), tuple(shape)))
