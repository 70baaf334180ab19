"""Assembling the manifest from the plan's columns and every rank's writes (on the coordinating
rank). Shard rows are assembled as columns, so the cost is a few array operations plus one small
record per tensor, however many pieces the ranks wrote."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from bcp.engine.writer import WrittenPieces
from bcp.layout.manifest import ByteRange, Manifest, ObjectEntry, TensorEntry
from bcp.layout.shard_table import ShardTable
from bcp.planning.save_plan import PlanColumns


def build_manifest(*, generation: int, framework: str, checksum_chunk: int, writer: str,
                   columns: PlanColumns, writes: list[list[Any]]) -> Manifest:
    """``columns`` are the plan's pieces (``save_plan.PlanColumns``); ``writes[r]`` is what rank r
    wrote (``RankWrites.to_wire``)."""
    files: list[str] = []
    file_base: list[int] = []
    for rank_files, *_ in writes:
        file_base.append(len(files))
        files.extend(rank_files)
    table, per_tensor = _shard_table(columns, [WrittenPieces.from_wire(w[1]) for w in writes], file_base)
    firsts = np.concatenate([[0], np.cumsum(per_tensor)]).tolist()
    tensors = {name: TensorEntry.from_table(name, dtype, shape, table, firsts[i], firsts[i + 1] - firsts[i])
               for i, (name, dtype, shape) in enumerate(zip(columns.names, columns.dtypes, columns.shapes))}
    return Manifest(generation=generation, world_size=len(writes), framework=framework, files=files,
                    tensors=tensors, objects=_object_entries(writes, file_base), checksum_chunk=checksum_chunk,
                    unsafe_pickle=any(w[3] for w in writes), created_unix=time.time(), writer=writer)


def _shard_table(columns: PlanColumns, written: list[WrittenPieces],
                 file_base: list[int]) -> tuple[ShardTable, np.ndarray]:
    """Every written piece as a shard row, grouped by tensor (rank order within a tensor), and the
    number of rows of each tensor."""
    rows = [columns.starts[rank] + w.index for rank, w in enumerate(written)]
    offsets = [columns.offsets[r] for r in rows]
    lengths = [columns.lengths[r] for r in rows]
    for w, box_offsets, box_lengths in zip(written, offsets, lengths):
        for position, part_offsets, part_lengths in w.parts:  # part of a split replicated piece
            box_offsets[position, :len(part_offsets)] = part_offsets
            box_lengths[position, :len(part_lengths)] = part_lengths
    where = np.concatenate([w.where + [[base, 0, 0]] for w, base in zip(written, file_base)]
                           or [np.zeros((0, 3), dtype=np.int64)])
    tensor = columns.tensor[np.concatenate(rows or [np.zeros(0, dtype=np.int64)])]
    order = np.argsort(tensor, kind="stable")

    crc_counts = np.concatenate([w.crc_counts for w in written] or [np.zeros(0, dtype=np.int64)])
    crcs = np.concatenate([w.crcs for w in written] or [np.zeros(0, dtype=np.uint32)])
    crc_starts = np.concatenate([[0], np.cumsum(crc_counts)[:-1]]).astype(np.int64)
    counts = crc_counts[order]
    crc_first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    gather = np.repeat(crc_starts[order] - crc_first[:-1], counts) + np.arange(crc_first[-1], dtype=np.int64)

    ndim = columns.ndim
    table = ShardTable(np.concatenate(offsets or [np.zeros((0, ndim), dtype=np.int64)])[order],
                       np.concatenate(lengths or [np.ones((0, ndim), dtype=np.int64)])[order],
                       where[order, 0], where[order, 1], where[order, 2], crc_first, crcs[gather])
    return table, np.bincount(tensor, minlength=len(columns.names))


def _object_entries(writes: list[list[Any]], file_base: list[int]) -> dict[str, ObjectEntry]:
    per_rank: dict[str, dict[int, tuple[ByteRange, int]]] = {}
    for rank, (_, _, object_writes, _) in enumerate(writes):
        for name, file, offset, nbytes, tree, crcs in object_writes:
            where = ByteRange(file_base[rank] + file, offset, nbytes, tuple(crcs))
            per_rank.setdefault(name, {})[rank] = (where, tree)
    objects: dict[str, ObjectEntry] = {}
    for name, by_rank in per_rank.items():
        holders = sorted(by_rank)
        index = {rank: i for i, rank in enumerate(holders)}
        objects[name] = ObjectEntry(name, [by_rank[r] for r in holders],
                                    [index.get(r, -1) for r in range(len(writes))])
    return objects
