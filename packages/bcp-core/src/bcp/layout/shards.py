"""Public types through which adapters hand the core a rank's piece of a global tensor.

A state-dict value may be a plain tensor (the whole tensor, taken as replicated across ranks), a
DTensor (its placement says which box this rank holds), or one of these, for frameworks that
describe sharding themselves (Megatron's ShardedTensor, FSDP1 and ZeRO flat parameters). A list
of them gives a rank several pieces of the same tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorShard:
    """``tensor`` holds the region of a ``global_shape`` tensor that starts at ``offsets``
    (its own shape gives the lengths). Ranks holding the same region are replicas."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.global_shape) or self.tensor.dim() != len(self.global_shape):
            raise ValueError(
                f"TensorShard: offsets {self.offsets}, local shape {tuple(self.tensor.shape)} and global "
                f"shape {self.global_shape} must have the same number of dimensions"
            )


@dataclass(frozen=True)
class FlatShard:
    """``tensor`` (1-D) holds elements ``[flat_offset, flat_offset + numel)`` of the row-major
    flattening of a ``global_shape`` tensor: a ZeRO/FSDP1 style piece that need not be a box."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    flat_offset: int

    def __post_init__(self) -> None:
        if self.tensor.dim() != 1:
            raise ValueError(f"FlatShard: tensor must be 1-D, got shape {tuple(self.tensor.shape)}")


# Exact types of plain local tensors: the common case, recognised without attribute probing.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(value: Any) -> bool:
    """A DTensor, recognised by its attributes so that the core need not import it."""
    return (type(value) not in PLAIN_TENSORS and isinstance(value, torch.Tensor)
            and hasattr(value, "device_mesh") and hasattr(value, "placements"))


def is_tensor_value(value: Any) -> bool:
    """Whether a state-dict value is tensor data (saved as boxes) rather than a plain value."""
    if type(value) in PLAIN_TENSORS:
        return True
    if isinstance(value, (list, tuple)) and value:
        return all(isinstance(v, (TensorShard, FlatShard)) for v in value)
    return isinstance(value, (torch.Tensor, TensorShard, FlatShard))
