"""Load planning: each wanted piece is intersected with the saved shards of its tensor, giving the
byte ranges to read and where in the destination they go (paper section 3.3, step 2)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from bcp.errors import MismatchError
from bcp.layout.box import Box
from bcp.layout.dtypes import dtype_from_name, dtype_name
from bcp.layout.manifest import Manifest
from bcp.layout.shard_table import ShardTable
from bcp.layout.piece import Piece, box_columns
from bcp.layout.read_op import ReadOp

#: Makes staging tensors: for each (live piece, shape, dtype), a host tensor of that shape and dtype.
Allocate = Callable[[list[tuple[torch.Tensor, tuple[int, ...], torch.dtype]]], list[torch.Tensor]]


def check_meta(manifest: Manifest, name: str, dtype: torch.dtype, shape: tuple[int, ...], path: str, *,
               cast_dtype: bool = False) -> None:
    """The live tensor must have the saved global shape, and the saved dtype unless ``cast_dtype``
    (whether or not it has pieces here)."""
    entry = manifest.tensors[name]
    if entry.dtype != dtype_name(dtype) and not cast_dtype:
        raise MismatchError(f"dtype mismatch: checkpoint has {entry.dtype}, the live tensor is {dtype_name(dtype)} "
                            "(load with cast_dtype=True to convert)", path=path, key=name)
    if entry.shape != tuple(shape):
        raise MismatchError(f"global shape mismatch: checkpoint has {list(entry.shape)}, the live tensor is "
                            f"{list(shape)}", path=path, key=name)


def staged(manifest: Manifest, pieces: list[Piece], *, every: bool, allocate: Allocate | None = None,
           in_host_memory: Callable[[torch.Tensor], bool] | None = None,
           ) -> tuple[list[Piece], list[tuple[Piece, torch.Tensor]]]:
    """The pieces to read, and (live piece, staging tensor) pairs to place once read: a piece is
    read into a staging tensor of the saved dtype when ``every`` (a transactional load), when its
    dtype is not the saved one (a cast load; placing converts), or when it is not in host memory
    (reads land in host memory; ``in_host_memory`` tells, by default a CPU tensor is).
    ``allocate`` makes the staging tensors (``torch.empty`` by default)."""
    on_host = in_host_memory or (lambda tensor: tensor.device.type == "cpu")
    reads, wanted = [], []
    for piece in pieces:
        saved = dtype_from_name(manifest.tensors[piece.name].dtype)
        if not every and piece.dtype == saved and on_host(piece.tensor):
            reads.append(piece)
        else:
            wanted.append((piece, saved))
    stagings = (allocate or _fresh)([(piece.tensor, piece.box.lengths, saved) for piece, saved in wanted])
    for (piece, saved), staging in zip(wanted, stagings):
        reads.append(Piece(piece.name, saved, piece.global_shape, piece.box, staging))
    return reads, [(piece, staging) for (piece, _), staging in zip(wanted, stagings)]


def _fresh(requests: list[tuple[torch.Tensor, tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dtype) for _, shape, dtype in requests]


def plan_reads(manifest: Manifest, pieces: list[Piece]) -> list[ReadOp]:
    """The reads that fill ``pieces``: one per (piece, saved shard) pair that overlap. Computed with
    array operations over the shard table, so thousands of pieces plan in milliseconds. The caller
    (the reader door) has checked that the shards of each tensor cover it exactly, so the reads of a
    piece fill it exactly."""
    groups: dict[int, tuple[ShardTable, list[tuple[Piece, int, int]]]] = {}
    for piece in pieces:
        table, first, count = manifest.tensors[piece.name].table_rows(manifest.checksum_chunk)
        groups.setdefault(id(table), (table, []))[1].append((piece, first, count))
    return [op for table, group in groups.values() for op in _plan_over(table, group)]


def _plan_over(table: ShardTable, group: list[tuple[Piece, int, int]]) -> list[ReadOp]:
    """Intersect each piece with its tensor's rows ``[first, first + count)`` of ``table``."""
    pieces = [piece for piece, _, _ in group]
    firsts = np.array([first for _, first, _ in group], dtype=np.int64)
    counts = np.array([count for _, _, count in group], dtype=np.int64)
    # A piece with more dimensions than the table belongs to a tensor without shards (an empty one):
    # cut, it meets none.
    wanted_lo, wanted_length = box_columns(pieces, table.ndim)
    wanted_hi = wanted_lo + wanted_length
    # One candidate pair per (piece, shard of its tensor), pieces in order.
    pair_piece = np.repeat(np.arange(len(pieces)), counts)
    pair_index = np.arange(len(pair_piece)) - np.repeat(np.cumsum(counts) - counts, counts)
    pair_row = firsts[pair_piece] + pair_index
    lo = np.maximum(table.offsets[pair_row], wanted_lo[pair_piece])
    hi = np.minimum(table.offsets[pair_row] + table.lengths[pair_row], wanted_hi[pair_piece])
    hit = np.all(hi > lo, axis=1)
    pair_piece, pair_index, pair_row = pair_piece[hit], pair_index[hit], pair_row[hit]
    lo, extent = lo[hit], (hi - lo)[hit]
    # Most reads fill their whole piece (loading into the saved layout): those share its box.
    whole = np.all((lo == wanted_lo[pair_piece]) & (extent == wanted_length[pair_piece]), axis=1)
    ndims = [pieces[p].box.ndim for p in pair_piece.tolist()]
    shards = table.entries(pair_row, ndims)
    ops = []
    for p, index, is_whole, shard, ndim, offsets, lengths in zip(
            pair_piece.tolist(), pair_index.tolist(), whole.tolist(), shards, ndims, lo.tolist(), extent.tolist()):
        piece = pieces[p]
        region = piece.box if is_whole else Box(tuple(offsets[:ndim]), tuple(lengths[:ndim]))
        ops.append(ReadOp(piece, shard, region, index))
    return ops
