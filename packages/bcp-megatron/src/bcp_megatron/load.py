"""Loading a Megatron sharded state dict from a bcp checkpoint, and its metadata.

Each rank asks for the boxes its ShardedTensors describe, whatever the parallel layout was at save
time: the core's load plan intersects them with the saved shards. A ShardedObject is read from the
record its main replica wrote, whichever rank that was.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

import bcp
from bcp.integration import (Checkpoint, Coordinator, Manifest, Piece, dtype_from_name, load_wanted, open_checkpoint,
                             pieces_of)

from bcp_megatron.adapter import NAME as FRAMEWORK
from bcp_megatron.saving import parallel_topology
from bcp_megatron.shards import clip_to, empty_like_chunk, entry_name, object_name, restored, sharded_key, tensor_shards

_LISTED = 20


class BcpLoader:
    """The load both strategy flavours share, with its options (``allow_pickle``, ``verify``,
    ``io_threads``, ``coordinator``, ``cast_dtype``, ``read_once``, ``transactional``, ``metrics_log``
    and ``topology`` are used)."""

    def __init__(self, options: bcp.LoadOptions) -> None:
        self.options = options

    def load(self, sharded_state_dict: dict, checkpoint_dir: "str | os.PathLike") -> dict:
        """Collective: fill every rank's ShardedTensors in place and return the state dict with each
        sharded value replaced by its loaded tensor or object. Runs bcp's load sequence, so no rank's
        tensors are written unless every rank read and verified its share."""
        return self.load_with_values(sharded_state_dict, checkpoint_dir, ())[0]

    def load_with_values(self, sharded_state_dict: dict, checkpoint_dir: "str | os.PathLike | bcp.MemoryTier",
                         values: tuple[str, ...]) -> tuple[dict, dict[str, Any], bcp.LoadResult]:
        """:meth:`load` from a folder or a memory tier, also reading the plain ``values`` saved
        beside the sharded state (each as the first rank that saved it wrote it); returns the state
        dict, those values by name and the load's result."""
        wanted = _ShardedWanted(sharded_state_dict, self.options, values)
        # Megatron-Core logs its strategies' routine work at DEBUG, as saving does.
        result = load_wanted(checkpoint_dir, wanted.plan, replace(self.options, topology=self.options.topology or
                                                                  parallel_topology(), summary_log_level=logging.DEBUG))
        return wanted.state_dict(), wanted.plain_values, result


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


class _ShardedWanted:
    """What a sharded state dict wants: the pieces of its ShardedTensors and its ShardedObjects'
    records. Megatron compares the keys with the checkpoint's itself (its ``StrictHandling``), so no
    left-over names are reported."""

    def __init__(self, sharded_state_dict: dict, options: bcp.LoadOptions, plain: tuple[str, ...] = ()) -> None:
        self.sharded_state_dict, self.options, self.plain = sharded_state_dict, options, plain
        #: The plain values read (``plain``), by name.
        self.plain_values: dict[str, Any] = {}
        self.pieces: list[Piece] = []
        self.values: dict[int, Any] = {}
        self.objects: list[tuple[ShardedObject, str]] = []
        #: (live data, zeroed copy read into) of tensors whose saved shape differs (allow_shape_mismatch).
        self.resized: list[tuple[torch.Tensor, torch.Tensor]] = []

    def plan(self, checkpoint: Checkpoint, result: bcp.LoadResult) -> "_ShardedWanted":
        manifest = _megatron(checkpoint).manifest
        absent: list[str] = []
        for value in nested_values(self.sharded_state_dict):
            if isinstance(value, ShardedTensor):
                name = entry_name(value.key)
                if name not in manifest.tensors:
                    absent.append(value.key)
                    continue
                self.pieces.extend(self._tensor_pieces(value, name, checkpoint))
                self.values[id(value)] = value.data
            elif isinstance(value, ShardedObject):
                name = object_name(value)
                if name not in manifest.objects:
                    absent.append(value.unique_key)
                    continue
                self.objects.append((value, name))
            else:
                raise bcp.UnsupportedValueError(f"cannot load into a {type(value).__name__}: only ShardedTensor and "
                                                "ShardedObject values are read by the strategy")
        unsaved = [name for name in self.plain if name not in manifest.objects]
        if unsaved:
            raise bcp.MismatchError(f"the checkpoint holds no {', '.join(unsaved)}: it was not saved with them "
                                    "(a memory tier's Megatron state is saved by bcp_megatron.save_to_tier)",
                                    path=checkpoint.path)
        if absent:
            more = f" and {len(absent) - _LISTED} more" if len(absent) > _LISTED else ""
            shown = ", ".join(sorted(absent)[:_LISTED]) + more
            raise bcp.MismatchError(f"{len(absent)} requested sharded key(s) are not in the checkpoint: {shown}; load "
                                    "with strict=StrictHandling.LOG_UNEXPECTED (or RETURN_UNEXPECTED) to skip them",
                                    path=checkpoint.path)
        return self

    def _tensor_pieces(self, sh_ten: ShardedTensor, name: str, checkpoint: Checkpoint) -> list[Piece]:
        saved_shape = checkpoint.tensors[name].shape
        resized = sh_ten.allow_shape_mismatch and tuple(sh_ten.global_shape) != saved_shape
        checkpoint.check_meta(name, sh_ten.dtype, saved_shape if resized else tuple(sh_ten.global_shape),
                              cast_dtype=self.options.cast_dtype)
        if sh_ten.data is None:
            sh_ten.data = empty_like_chunk(sh_ten)
        if not resized:
            return [piece for shard in tensor_shards(sh_ten) for piece in pieces_of(name, shard)]
        # what lies outside the saved tensor stays defined: read into zeros, copied in once applied
        zeros = torch.zeros_like(sh_ten.data)
        self.resized.append((sh_ten.data, zeros))
        shards = clip_to(tensor_shards(replace(sh_ten, data=zeros)), saved_shape)
        return [piece for shard in shards for piece in pieces_of(name, shard)]

    def left_over(self) -> None:
        return None

    def read_values(self, checkpoint: Checkpoint, coord: Coordinator, result: bcp.LoadResult) -> dict[str, Any]:
        # each object from the record its main replica wrote, whichever rank that was
        sources = {name: checkpoint.value_source(name) for name in [n for _, n in self.objects] + list(self.plain)}
        return checkpoint.read_objects(sources, allow_pickle=self.options.allow_pickle)

    def apply(self, loaded: dict[str, Any]) -> None:
        for data, zeros in self.resized:
            data.detach().copy_(zeros)
        for value, name in self.objects:
            self.values[id(value)] = restored(loaded[name])
        self.plain_values = {name: loaded[name] for name in self.plain}

    def state_dict(self) -> dict:
        """The state dict with each sharded value replaced by what was loaded into it."""
        return dict_list_map_outplace(lambda value: self.values[id(value)], self.sharded_state_dict)
