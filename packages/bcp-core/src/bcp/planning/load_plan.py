"""Load planning: each wanted piece is intersected with the saved shards of its tensor, giving the
byte ranges to read and where in the destination they go (paper section 3.3, step 2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bcp.errors import CorruptCheckpointError, MismatchError
from bcp.layout.box import Box
from bcp.layout.dtypes import dtype_name
from bcp.layout.manifest import Manifest, ShardEntry
from bcp.planning.pieces import Piece


@dataclass(slots=True)
class ReadOp:
    """Copy ``region`` (global coordinates) of a saved shard into a destination piece."""

    piece: Piece
    shard: ShardEntry
    region: Box
    #: Position of ``shard`` among its tensor's shards: with the tensor name, it names the shard.
    shard_index: int


def check_meta(manifest: Manifest, name: str, dtype: torch.dtype, shape: tuple[int, ...], path: str) -> None:
    """The live tensor must have the saved dtype and global shape (whether or not it has pieces here)."""
    entry = manifest.tensors[name]
    if entry.dtype != dtype_name(dtype):
        raise MismatchError(f"dtype mismatch: checkpoint has {entry.dtype}, the live tensor is {dtype_name(dtype)}",
                            path=path, key=name)
    if entry.shape != tuple(shape):
        raise MismatchError(f"global shape mismatch: checkpoint has {list(entry.shape)}, the live tensor is "
                            f"{list(shape)}", path=path, key=name)


def plan_reads(manifest: Manifest, pieces: list[Piece], path: str) -> list[ReadOp]:
    ops: list[ReadOp] = []
    for piece in pieces:
        entry = manifest.tensors[piece.name]
        covered = 0
        for index, shard in enumerate(entry.shards):
            region = shard.box.intersect(piece.box)
            if region is not None:
                ops.append(ReadOp(piece, shard, region, index))
                covered += region.numel
        if covered != piece.box.numel:
            raise CorruptCheckpointError(
                f"the saved shards cover {covered} of the {piece.box.numel} elements wanted in {piece.box}",
                path=path, key=piece.name)
    return ops
