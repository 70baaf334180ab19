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

from bcp.api.location import resolve
from bcp.coord import Coordinator, default_coordinator
from bcp.coord.consensus import Outcome, all_agree, broadcast_from_root
from bcp.engine.location import Location
from bcp.engine.reader import ShardReader
from bcp.errors import CheckpointError, MismatchError, UnsupportedValueError
from bcp.layout.dtypes import dtype_from_name
from bcp.layout.manifest import Manifest, ObjectEntry
from bcp.planning.load_plan import check_meta, plan_reads
from bcp.planning.pieces import Piece, pieces_of

from bcp_megatron.adapter import NAME as FRAMEWORK
from bcp_megatron.shards import clip_to, empty_like_chunk, entry_name, object_name, restored, sharded_key, tensor_shards

_LISTED = 20


class BcpLoader:
    """The load both strategy flavours share, with its options."""

    def __init__(self, *, allow_pickle: bool, verify: bool, io_threads: int, coordinator: Coordinator | None) -> None:
        self.allow_pickle = allow_pickle
        self.verify = verify
        self.io_threads = io_threads
        self.coordinator = coordinator

    def load(self, sharded_state_dict: dict, checkpoint_dir: "str | os.PathLike") -> dict:
        return load_sharded(sharded_state_dict, checkpoint_dir, self.coordinator or default_coordinator(),
                            allow_pickle=self.allow_pickle, verify=self.verify, io_threads=self.io_threads)


def load_sharded(sharded_state_dict: dict, checkpoint_dir: "str | os.PathLike", coord: Coordinator, *,
                 allow_pickle: bool, verify: bool, io_threads: int) -> dict:
    """Collective: fill every rank's ShardedTensors in place and return the state dict with each
    sharded value replaced by its loaded tensor or object."""
    location = resolve(checkpoint_dir, None)
    found = Outcome.of(lambda: _newest_manifest_files(location)) if coord.rank == 0 else Outcome()
    generation, data, table = broadcast_from_root(coord, found, f"opening {location.display}")
    loaded = Outcome.of(lambda: _read(sharded_state_dict, location, generation,
                                      _megatron(Manifest.decode(data, table, path=location.display), location.display),
                                      allow_pickle, verify, io_threads))
    all_agree(coord, Outcome(error=loaded.error), f"loading {location.display}")
    return loaded.value


def read_manifest(checkpoint_dir: "str | os.PathLike") -> Manifest:
    """The newest committed manifest, read by this process alone (no collectives)."""
    location = resolve(checkpoint_dir, None)
    return _megatron(location.read_manifest(location.latest_committed()), location.display)


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


def _newest_manifest_files(location: Location) -> list[Any]:
    generation = location.latest_committed()
    return [generation, *location.read_manifest_files(generation)]


def _megatron(manifest: Manifest, display: str) -> Manifest:
    if manifest.framework != FRAMEWORK:
        raise CheckpointError(f"this bcp checkpoint was saved from {manifest.framework!r} state, not by Megatron's "
                              "dist_checkpointing; load it with bcp.load", path=display)
    return manifest


def _read(sharded_state_dict: dict, location: Location, generation: int, manifest: Manifest,
          allow_pickle: bool, verify: bool, io_threads: int) -> dict:
    values: dict[int, Any] = {}
    pieces: list[Piece] = []
    objects: list[tuple[ShardedObject, ObjectEntry]] = []
    absent: list[str] = []
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor):
            name = entry_name(value.key)
            if name not in manifest.tensors:
                absent.append(value.key)
                continue
            pieces.extend(_tensor_pieces(value, name, manifest, location.display))
            values[id(value)] = value.data
        elif isinstance(value, ShardedObject):
            entry = manifest.objects.get(object_name(value))
            if entry is None:
                absent.append(value.unique_key)
                continue
            objects.append((value, entry))
        else:
            raise UnsupportedValueError(f"cannot load into a {type(value).__name__}: only ShardedTensor and "
                                        "ShardedObject values are read by the strategy")
    if absent:
        more = f" and {len(absent) - _LISTED} more" if len(absent) > _LISTED else ""
        shown = ", ".join(sorted(absent)[:_LISTED]) + more
        raise MismatchError(f"{len(absent)} requested sharded key(s) are not in the checkpoint: {shown}; load with "
                            "strict=StrictHandling.LOG_UNEXPECTED (or RETURN_UNEXPECTED) to skip them",
                            path=location.display)
    reader = ShardReader(location, generation, manifest, verify=verify)
    reader.run(plan_reads(manifest, pieces, location.display), io_threads)
    for value, entry in objects:
        owner = next(rank for rank, record in enumerate(entry.ranks) if record >= 0)
        values[id(value)] = restored(reader.read_object(entry, owner, allow_pickle=allow_pickle))
    return dict_list_map_outplace(lambda value: values[id(value)], sharded_state_dict)


def _tensor_pieces(sh_ten: ShardedTensor, name: str, manifest: Manifest, display: str) -> list[Piece]:
    saved_shape = manifest.tensors[name].shape
    resized = sh_ten.allow_shape_mismatch and tuple(sh_ten.global_shape) != saved_shape
    check_meta(manifest, name, sh_ten.dtype, saved_shape if resized else tuple(sh_ten.global_shape), display)
    if sh_ten.data is None:
        sh_ten.data = empty_like_chunk(sh_ten)
    elif sh_ten.allow_shape_mismatch:
        sh_ten.data.detach().zero_()  # what lies outside the saved tensor stays defined
    shards = tensor_shards(sh_ten)
    if resized:
        shards = clip_to(shards, saved_shape)
    return [piece for shard in shards for piece in pieces_of(name, shard)]
