"""Megatron's sharded values in bcp's terms: entry names, tensor pieces and storable objects.

A ``ShardedTensor`` is a box of a global tensor: ``global_offset`` and the local shape, with
``prepend_axis_num`` leading axes of length 1 (layer-stacked weights). That holds for regular grids
and for the irregular 1-D pieces of the distributed optimizer (``axis_fragmentations=None``) alike.
Megatron <= 0.15 also cuts a box further with ``flattened_range``: the data is then a flat slice
of the box's row-major flattening, which becomes the few regular boxes that cover it.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica

from bcp import CorruptCheckpointError, MismatchError, TensorShard, UnsupportedValueError
from bcp.integration import Box, flat_range_to_boxes

MODEL = "model"
OPTIMIZER = "optimizer"
_OPTIMIZER_PREFIX = "optimizer."
# Transformer Engine's older ``_extra_state`` is an io.BytesIO; it is stored as this one-key dict.
_BYTES_IO = "$megatron.io.BytesIO"


def entry_name(key: str) -> str:
    """The bcp entry of a Megatron key: ``optimizer.*`` keys form the ``optimizer`` component,
    every other key the ``model`` component, under Megatron's own name."""
    component = OPTIMIZER if key.startswith(_OPTIMIZER_PREFIX) else MODEL
    return f"{component}/{key}"


def sharded_key(name: str) -> str:
    """Inverse of :func:`entry_name`."""
    return name.split("/", 1)[1]


def object_name(sh_obj: ShardedObject) -> str:
    """A ShardedObject is one element of a global object array: its unique key names it."""
    return entry_name(sh_obj.unique_key)


def chunk_box(sh_ten: ShardedTensor) -> Box:
    """The box of the global tensor that the ShardedTensor's local chunk covers."""
    lengths = (1,) * sh_ten.prepend_axis_num + tuple(sh_ten.local_shape)
    return Box(tuple(sh_ten.global_offset), lengths)


def tensor_shards(sh_ten: ShardedTensor) -> list[TensorShard]:
    """The boxes of ``sh_ten.data``, as views of it (loading into them fills ``data`` in place)."""
    data = sh_ten.data.detach()
    box = chunk_box(sh_ten)
    global_shape = tuple(sh_ten.global_shape)
    flat = getattr(sh_ten, "flattened_range", None)
    if flat is None:
        if tuple(data.shape) != tuple(sh_ten.local_shape):
            raise UnsupportedValueError(
                f"data shape {tuple(data.shape)} differs from local_shape {tuple(sh_ten.local_shape)}",
                key=sh_ten.key)
        # unsqueeze (not view) keeps aliasing even for non-contiguous data.
        for _ in range(sh_ten.prepend_axis_num):
            data = data.unsqueeze(0)
        return [TensorShard(data, global_shape, box.offsets)]
    if data.dim() != 1 or data.numel() != flat.stop - flat.start:
        raise UnsupportedValueError(
            f"flattened_range {flat} needs 1-D data of {flat.stop - flat.start} elements, "
            f"got shape {tuple(data.shape)}", key=sh_ten.key)
    if flat.stop == flat.start:  # an empty box still names its tensor
        return [TensorShard(data.view((0,) * len(global_shape)), global_shape, (0,) * len(global_shape))]
    return [
        TensorShard(data[at: at + part.numel].view(part.lengths), global_shape,
                    tuple(o + p for o, p in zip(box.offsets, part.offsets)))
        for part, at in flat_range_to_boxes(box.lengths, flat.start, flat.stop - flat.start)
    ]


def clip_to(shards: list[TensorShard], saved_shape: tuple[int, ...]) -> list[TensorShard]:
    """For ``allow_shape_mismatch`` tensors (e.g. padded vocabularies): the parts of each shard
    that lie inside the saved global shape, addressed in it."""
    clipped = []
    for shard in shards:
        box = Box(tuple(shard.offsets), tuple(shard.tensor.shape))
        inside = box.intersect(Box.whole(saved_shape))
        if inside is not None:
            clipped.append(TensorShard(shard.tensor[inside.relative_to(box).slices()], saved_shape,
                                       inside.offsets))
    return clipped


def storable(value: Any) -> list[Any]:
    """An object value as bcp stores it: in a one-element list, so that a tensor-valued object
    (e.g. ``_extra_state``) stays an object rather than becoming a replicated tensor; a BytesIO
    becomes its bytes, tagged."""
    if isinstance(value, io.BytesIO):
        value = {_BYTES_IO: value.getvalue()}
    return [value]


def restored(stored: Any) -> Any:
    """Inverse of :func:`storable`."""
    if not (isinstance(stored, list) and len(stored) == 1):
        raise CorruptCheckpointError(
            f"a Megatron object is stored as a one-element list, found {type(stored).__name__}")
    value = stored[0]
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get(_BYTES_IO), bytes):
        return io.BytesIO(value[_BYTES_IO])
    return value


def empty_like_chunk(sh_ten: ShardedTensor) -> torch.Tensor:
    """Host memory for a ShardedTensor requested without data, as torch_dist allocates it (zeros
    when the shape may mismatch, so the part outside the saved tensor is defined)."""
    flat = getattr(sh_ten, "flattened_range", None)
    shape = (flat.stop - flat.start,) if flat is not None else tuple(sh_ten.local_shape)
    init = torch.zeros if sh_ten.allow_shape_mismatch else torch.empty
    return init(shape, dtype=sh_ten.dtype)


def save_values(sharded_state_dict: dict) -> dict[str, dict[str, Any]]:
    """A rank's sharded state dict in bcp's terms: per component, its tensors (lists of
    TensorShard, by Megatron key) and objects (by unique key).

    Every replica of a tensor box is offered (the core writes each box once, spreading the writes
    over the replicas); an object is saved by its main replica, as Megatron defines it."""
    components: dict[str, dict[str, Any]] = {}
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor):
            if value.data is None:
                raise UnsupportedValueError("a ShardedTensor without data cannot be saved", key=value.key)
            name = entry_name(value.key)
            component, key = name.split("/", 1)
            shards = tensor_shards(value)
            components.setdefault(component, {}).setdefault(key, []).extend(shards)
        elif isinstance(value, ShardedObject):
            if is_main_replica(value.replica_id):
                component, key = object_name(value).split("/", 1)
                values = components.setdefault(component, {})
                if key in values:
                    raise MismatchError("this rank holds the main replica of the ShardedObject twice", key=key)
                values[key] = storable(value.data)
        else:
            raise UnsupportedValueError(f"a sharded state dict may hold only ShardedTensor and ShardedObject "
                                        f"values here, got {type(value).__name__}")
    return components
