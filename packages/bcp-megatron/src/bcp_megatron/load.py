"""Loading a Megatron sharded state dict from a bcp checkpoint, and its metadata.

Each rank asks for the boxes its ShardedTensors describe, whatever the parallel layout was at save
time: the core's load plan intersects them with the saved shards. A ShardedObject is read from the
record its main replica wrote, whichever rank that was.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

import bcp
from bcp.integration import (Checkpoint, Manifest, Outcome, Piece, all_agree, as_coordinator,
                             dtype_from_name, open_checkpoint, pieces_of)

from bcp_megatron.adapter import NAME as FRAMEWORK
from bcp_megatron.shards import clip_to, empty_like_chunk, entry_name, object_name, restored, sharded_key, tensor_shards

_LISTED = 20


class BcpLoader:
    """The load both strategy flavours share, with its options (``allow_pickle``, ``verify``,
    ``io_threads``, ``coordinator``, ``cast_dtype`` are used)."""

    def __init__(self, options: bcp.LoadOptions) -> None:
        self.options = options

    def load(self, sharded_state_dict: dict, checkpoint_dir: "str | os.PathLike") -> dict:
        """Collective: fill every rank's ShardedTensors in place and return the state dict with each
        sharded value replaced by its loaded tensor or object."""
        options = self.options
        coord = as_coordinator(options.coordinator)
        checkpoint = open_checkpoint(checkpoint_dir, verify=options.verify, io_threads=options.io_threads,
                                     coordinator=coord)
        loaded = Outcome.of(lambda: _read(sharded_state_dict, _megatron(checkpoint), options))
        all_agree(coord, Outcome(error=loaded.error), f"loading {checkpoint.path}")
        return loaded.value


def read_manifest(checkpoint_dir: "str | os.PathLike") -> Manifest:
    """The newest committed manifest, read by this process alone (no collectives)."""
    return _megatron(open_checkpoint(checkpoint_dir)).manifest


def tensors_metadata(manifest: Manifest) -> dict[str, ShardedTensor]:
    """Megatron's view of the saved tensors: an unsharded, data-less ShardedTensor per key."""
    return {
        sharded_key(name): ShardedTensor.from_rank_offsets(
            sharded_key(name), torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device="meta")
        ).without_data()
        for name, entry in manifest.tensors.items()
    }


def sharded_metadata(manifest: Manifest) -> dict[str, ShardedTensor | ShardedObject]:
    """:func:`tensors_metadata` plus one data-less ShardedObject per saved object, by unique key."""
    objects = {}
    for name in manifest.objects:
        unique_key = sharded_key(name)
        objects[unique_key] = ShardedObject.empty_from_unique_key(unique_key)
    return {**tensors_metadata(manifest), **objects}


def _megatron(checkpoint: Checkpoint) -> Checkpoint:
    if checkpoint.manifest.framework != FRAMEWORK:
        raise bcp.CheckpointError(f"this bcp checkpoint was saved from {checkpoint.manifest.framework!r} state, not "
                                  "by Megatron's dist_checkpointing; load it with bcp.load", path=checkpoint.path)
    return checkpoint


def _read(sharded_state_dict: dict, checkpoint: Checkpoint, options: bcp.LoadOptions) -> dict:
    manifest = checkpoint.manifest
    values: dict[int, Any] = {}
    pieces: list[Piece] = []
    objects: list[tuple[ShardedObject, str]] = []
    absent: list[str] = []
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor):
            name = entry_name(value.key)
            if name not in manifest.tensors:
                absent.append(value.key)
                continue
            pieces.extend(_tensor_pieces(value, name, checkpoint, options.cast_dtype))
            values[id(value)] = value.data
        elif isinstance(value, ShardedObject):
            name = object_name(value)
            if name not in manifest.objects:
                absent.append(value.unique_key)
                continue
            objects.append((value, name))
        else:
            raise bcp.UnsupportedValueError(f"cannot load into a {type(value).__name__}: only ShardedTensor and "
                                            "ShardedObject values are read by the strategy")
    if absent:
        more = f" and {len(absent) - _LISTED} more" if len(absent) > _LISTED else ""
        shown = ", ".join(sorted(absent)[:_LISTED]) + more
        raise bcp.MismatchError(f"{len(absent)} requested sharded key(s) are not in the checkpoint: {shown}; load "
                                "with strict=StrictHandling.LOG_UNEXPECTED (or RETURN_UNEXPECTED) to skip them",
                                path=checkpoint.path)
    checkpoint.read_pieces(pieces)
    for value, name in objects:  # read from the record its main replica wrote, whichever rank that was
        owner = checkpoint.value_source(name)
        values[id(value)] = restored(checkpoint.read_object(name, rank=owner, allow_pickle=options.allow_pickle))
    return dict_list_map_outplace(lambda value: values[id(value)], sharded_state_dict)


def _tensor_pieces(sh_ten: ShardedTensor, name: str, checkpoint: Checkpoint, cast_dtype: bool) -> list[Piece]:
    saved_shape = checkpoint.tensors[name].shape
    resized = sh_ten.allow_shape_mismatch and tuple(sh_ten.global_shape) != saved_shape
    checkpoint.check_meta(name, sh_ten.dtype, saved_shape if resized else tuple(sh_ten.global_shape),
                          cast_dtype=cast_dtype)
    if sh_ten.data is None:
        sh_ten.data = empty_like_chunk(sh_ten)
    elif sh_ten.allow_shape_mismatch:
        sh_ten.data.detach().zero_()  # what lies outside the saved tensor stays defined
    shards = tensor_shards(sh_ten)
    if resized:
        shards = clip_to(shards, saved_shape)
    return [piece for shard in shards for piece in pieces_of(name, shard)]
