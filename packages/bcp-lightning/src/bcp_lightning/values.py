"""State-dict values as bcp takes them.

Plain tensors and DTensors go to bcp unchanged. FSDP1's sharded state dicts hold ``ShardedTensor``s
(a ``torch.Tensor`` subclass that bcp does not read), so they are described as ``bcp.TensorShard``s
that alias their local shards: bcp reads from them on save and fills them in place on load.
"""

from __future__ import annotations

from typing import Any

import torch

import bcp


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed`` ``ShardedTensor`` (duck-typed: its module is private)."""
    return isinstance(value, torch.Tensor) and callable(getattr(value, "local_shards", None))


def as_bcp_value(value: Any) -> Any:
    """``value`` in a form bcp reads and fills; a ShardedTensor becomes its local ``TensorShard``s."""
    if not is_sharded_tensor(value):
        return value
    global_shape = tuple(value.size())
    shards = [bcp.TensorShard(s.tensor, global_shape, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]
    if shards:
        return shards
    # A rank without a shard still names the tensor (bcp needs its dtype and shape on every rank).
    dtype = value.metadata().tensor_properties.dtype
    return [bcp.TensorShard(torch.empty([0] * len(global_shape), dtype=dtype), global_shape, (0,) * len(global_shape))]


def tensor_description(value: Any) -> tuple[torch.dtype, list[int]] | None:
    """dtype and global shape of a tensor value as ``as_bcp_value`` returns it; None for other values."""
    if isinstance(value, list) and value and all(isinstance(v, bcp.TensorShard) for v in value):
        return value[0].tensor.dtype, list(value[0].global_shape)
    if isinstance(value, torch.Tensor):
        return value.dtype, list(value.shape)
    return None
