"""What a rank wrote: its data files and where each piece and value record lies in them, with the
chunk checksums. The coordinator assembles the manifest from every rank's report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(slots=True)
class WrittenPieces:
    """A rank's written pieces as columns: the local piece ``index`` of each (``parts`` lists
    ``[row, offsets, lengths]`` for rows that are part of a split piece), ``where`` = file index,
    byte offset and byte length, and each row's ``crc_counts`` chunk checksums in ``crcs``."""

    index: np.ndarray
    parts: list[list[Any]]
    where: np.ndarray
    crc_counts: np.ndarray
    crcs: np.ndarray

    def to_wire(self) -> list[Any]:
        return [self.index.tobytes(), self.parts, self.where.tobytes(), self.crc_counts.tobytes(),
                self.crcs.tobytes()]

    @staticmethod
    def from_wire(wire: list[Any]) -> "WrittenPieces":
        index, parts, where, crc_counts, crcs = wire
        return WrittenPieces(np.frombuffer(index, dtype=np.int64), parts,
                             np.frombuffer(where, dtype=np.int64).reshape(-1, 3),
                             np.frombuffer(crc_counts, dtype=np.int64), np.frombuffer(crcs, dtype=np.uint32))

    @staticmethod
    def of(rows: list["PieceRecord"]) -> "WrittenPieces":
        return WrittenPieces(
            index=np.array([r.index for r in rows], dtype=np.int64),
            parts=[[i, list(r.part_offsets), list(r.part_lengths)] for i, r in enumerate(rows)
                   if r.part_offsets is not None],
            where=np.array([(r.file, r.offset, r.nbytes) for r in rows], dtype=np.int64).reshape(-1, 3),
            crc_counts=np.array([len(r.crcs) for r in rows], dtype=np.int64),
            crcs=np.array([c for r in rows for c in r.crcs], dtype=np.uint32))


@dataclass(slots=True)
class PieceRecord:
    """Where the writer put local piece ``index`` (or the part of it given by ``part_*``)."""

    index: int
    part_offsets: tuple[int, ...] | None
    part_lengths: tuple[int, ...] | None
    file: int
    offset: int
    nbytes: int
    crcs: list[int]


@dataclass(slots=True)
class ValueRecord:
    """Where the writer put a value's record; ``ranks`` as in ``write_plan.ValueWrite``."""

    name: str
    file: int
    offset: int
    nbytes: int
    tree_nbytes: int
    crcs: list[int]
    ranks: list[int] | None = None

    def to_wire(self) -> list[Any]:
        return [self.name, self.file, self.offset, self.nbytes, self.tree_nbytes, self.crcs, self.ranks]

    @staticmethod
    def from_wire(wire: list[Any]) -> "ValueRecord":
        return ValueRecord(*wire)


@dataclass(slots=True)
class RankWrites:
    """One rank's report: file names (relative to the generation), its pieces and value records,
    whether any value was pickled and whether any record refers to tensors saved beside it."""

    files: list[str]
    pieces: WrittenPieces
    values: list[ValueRecord]
    used_pickle: bool
    used_refs: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.pieces.where[:, 2].sum()) + sum(v.nbytes for v in self.values)

    def to_wire(self) -> list[Any]:
        return [self.files, self.pieces.to_wire(), [v.to_wire() for v in self.values], self.used_pickle,
                self.used_refs]

    @staticmethod
    def from_wire(wire: list[Any]) -> "RankWrites":
        files, pieces, values, used_pickle, used_refs = wire
        return RankWrites(files, WrittenPieces.from_wire(pieces), [ValueRecord.from_wire(v) for v in values],
                          used_pickle, used_refs)
