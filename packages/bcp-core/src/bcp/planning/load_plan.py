"""Load planning: each wanted piece is intersected with the saved shards of its tensor, giving the
byte ranges to read and where in the destination they go (paper section 3.3, step 2)."""

from __future__ import annotations

from dataclasses import dataclass

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


def plan_reads(manifest: Manifest, pieces: list[Piece], path: str) -> list[ReadOp]:
    ops: list[ReadOp] = []
    for piece in pieces:
        entry = manifest.tensors[piece.name]
        if entry.dtype != dtype_name(piece.dtype):
            raise MismatchError(
                f"dtype mismatch: checkpoint has {entry.dtype}, the live tensor is {dtype_name(piece.dtype)}",
                path=path, key=piece.name)
        if entry.shape != piece.global_shape:
            raise MismatchError(
                f"global shape mismatch: checkpoint has {list(entry.shape)}, the live tensor is "
                f"{list(piece.global_shape)}", path=path, key=piece.name)
        covered = 0
        for shard in entry.shards:
            region = shard.box.intersect(piece.box)
            if region is not None:
                ops.append(ReadOp(piece, shard, region))
                covered += region.numel
        if covered != piece.box.numel:
            raise CorruptCheckpointError(
                f"the saved shards cover {covered} of the {piece.box.numel} elements wanted in {piece.box}",
                path=path, key=piece.name)
    return ops
