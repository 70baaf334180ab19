"""Assembling a generation's manifest on the coordinating rank, from the plan's columns and every
rank's write report. Shard rows are assembled as columns, so the cost is a few array operations plus
one small record per tensor, however many pieces the ranks wrote."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from bcp.chunk_codecs import Compression
from bcp.layout.manifest import ByteRange, Manifest, ObjectEntry, TensorEntry, format_version
from bcp.layout.shard_table import ChunkColumns, ShardTable
from bcp.layout.write_report import RankWrites, WrittenPieces
from bcp.planning.save_plan import PlanColumns


def assemble_manifest(*, generation: int, framework: str, checksum_chunk: int, writer: str, columns: PlanColumns,
                      reports: list[RankWrites], world_size: int | None = None,
                      compression: Compression | None = None) -> Manifest:
    """``columns`` are the plan's pieces; ``reports[r]`` is what rank r wrote (and the pieces it
    found stored by an earlier generation). ``world_size`` is the saved world's (default: one
    report per rank); ``compression`` what the save asked for."""
    files: list[str] = []
    file_base: list[int] = []
    for report in reports:
        file_base.append(len(files))
        files.extend(report.files)
    earlier: dict[str, int] = {}  # a file of an earlier generation is listed once, whichever ranks use it
    compressed = any(w.chunks is not None for r in reports for w in (r.pieces, r.reused))
    rows = []
    for report, base in zip(reports, file_base):
        indices = np.array([earlier.setdefault(name, len(files) + len(earlier)) for name in report.earlier_files],
                           dtype=np.int64)
        own, reused = report.pieces, report.reused
        if compressed:  # then every row has stored chunks (raw ones where a rank compressed none)
            own, reused = own.with_chunks(checksum_chunk), reused.with_chunks(checksum_chunk)
        own = dataclasses.replace(own, where=own.where + [[base, 0, 0]])
        rows.append(WrittenPieces.concat(own, reused, indices) if len(reused.index) else own)
    files.extend(earlier)
    table, per_tensor = _shard_table(columns, rows)
    firsts = np.concatenate([[0], np.cumsum(per_tensor)]).tolist()
    tensors = {name: TensorEntry.from_table(name, dtype, shape, table, firsts[i], firsts[i + 1] - firsts[i])
               for i, (name, dtype, shape) in enumerate(zip(columns.names, columns.dtypes, columns.shapes))}
    world_size = len(reports) if world_size is None else world_size
    return Manifest(generation=generation, world_size=world_size, framework=framework, files=files,
                    tensors=tensors, objects=_object_entries(reports, file_base, world_size),
                    checksum_chunk=checksum_chunk, unsafe_pickle=any(r.used_pickle for r in reports),
                    created_unix=time.time(), writer=writer,
                    version=format_version(any(r.used_refs for r in reports), bool(earlier), compressed),
                    compression=compression if compressed else None)


def _shard_table(columns: PlanColumns, written: list[WrittenPieces]) -> tuple[ShardTable, np.ndarray]:
    """Every written piece (``written[r]``: rank r's, file indices into the manifest's ``files``)
    as a shard row, grouped by tensor (rank order within a tensor), and the number of rows of
    each tensor."""
    rows = [columns.starts[rank] + w.index for rank, w in enumerate(written)]
    offsets = [columns.offsets[r] for r in rows]
    lengths = [columns.lengths[r] for r in rows]
    for w, box_offsets, box_lengths in zip(written, offsets, lengths):
        for position, part_offsets, part_lengths in w.parts:  # part of a split replicated piece
            box_offsets[position, :len(part_offsets)] = part_offsets
            box_lengths[position, :len(part_lengths)] = part_lengths
    where = np.concatenate([w.where for w in written] or [np.zeros((0, 3), dtype=np.int64)])
    tensor = columns.tensor[np.concatenate(rows or [np.zeros(0, dtype=np.int64)])]
    order = np.argsort(tensor, kind="stable")

    crc_counts = np.concatenate([w.crc_counts for w in written] or [np.zeros(0, dtype=np.int64)])
    crcs = np.concatenate([w.crcs for w in written] or [np.zeros(0, dtype=np.uint32)])
    crc_starts = np.concatenate([[0], np.cumsum(crc_counts)[:-1]]).astype(np.int64)
    counts = crc_counts[order]
    crc_first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    gather = np.repeat(crc_starts[order] - crc_first[:-1], counts) + np.arange(crc_first[-1], dtype=np.int64)

    chunks = None
    if written and written[0].chunks is not None:
        stored_nbytes, *per_chunk = (np.concatenate(c) for c in zip(*(w.chunks.arrays() for w in written)))
        chunks = ChunkColumns(stored_nbytes[order], *(c[gather] for c in per_chunk))
    ndim = columns.ndim
    table = ShardTable(np.concatenate(offsets or [np.zeros((0, ndim), dtype=np.int64)])[order],
                       np.concatenate(lengths or [np.ones((0, ndim), dtype=np.int64)])[order],
                       where[order, 0], where[order, 1], where[order, 2], crc_first, crcs[gather], chunks)
    return table, np.bincount(tensor, minlength=len(columns.names))


def _object_entries(reports: list[RankWrites], file_base: list[int], world_size: int) -> dict[str, ObjectEntry]:
    """One entry per value name: its records, and for each saved rank the record it saved (a record
    names its ranks, or stands for the rank that wrote it)."""
    per_name: dict[str, tuple[list[tuple[ByteRange, int]], list[int]]] = {}
    for rank, report in enumerate(reports):
        for v in report.values:
            records, ranks = per_name.setdefault(v.name, ([], [-1] * world_size))
            for holder in (v.ranks if v.ranks is not None else [rank]):
                ranks[holder] = len(records)
            records.append((ByteRange(file_base[rank] + v.file, v.offset, v.nbytes, tuple(v.crcs)), v.tree_nbytes))
    return {name: ObjectEntry(name, records, ranks) for name, (records, ranks) in per_name.items()}
