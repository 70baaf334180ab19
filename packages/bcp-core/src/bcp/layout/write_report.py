"""What a rank wrote: its data files and where each piece and value record lies in them, with the
chunk checksums, and the pieces it did not write because an earlier generation stores their bytes
(an incremental save's). The coordinator assembles the manifest from every rank's report."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    def empty() -> "WrittenPieces":
        return WrittenPieces.of([])

    @staticmethod
    def concat(first: "WrittenPieces", second: "WrittenPieces", second_files: np.ndarray) -> "WrittenPieces":
        """``first``'s rows, then ``second``'s with file ``i`` renamed ``second_files[i]``."""
        where = second.where.copy()
        where[:, 0] = second_files[where[:, 0]] if len(where) else where[:, 0]
        shift = len(first.index)
        return WrittenPieces(np.concatenate([first.index, second.index]),
                             first.parts + [[row + shift, offsets, lengths] for row, offsets, lengths in second.parts],
                             np.concatenate([first.where, where]), np.concatenate([first.crc_counts, second.crc_counts]),
                             np.concatenate([first.crcs, second.crcs]))

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
    """One rank's report: the files it wrote (names relative to the generation), its pieces and
    value records in them, whether any value was pickled and whether any record refers to tensors
    saved beside it; and the pieces whose bytes ``reused`` it did not write, in data files of earlier
    generations (``earlier_files``, named from the checkpoint path: ``layout.references``)."""

    files: list[str]
    pieces: WrittenPieces
    values: list[ValueRecord]
    used_pickle: bool
    used_refs: bool = False
    reused: WrittenPieces = field(default_factory=WrittenPieces.empty)
    earlier_files: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes written (not those reused)."""
        return int(self.pieces.where[:, 2].sum()) + sum(v.nbytes for v in self.values)

    @property
    def reused_nbytes(self) -> int:
        return int(self.reused.where[:, 2].sum())

    def to_wire(self) -> list[Any]:
        return [self.files, self.pieces.to_wire(), [v.to_wire() for v in self.values], self.used_pickle,
                self.used_refs, self.reused.to_wire(), self.earlier_files]

    @staticmethod
    def from_wire(wire: list[Any]) -> "RankWrites":
        files, pieces, values, used_pickle, used_refs, reused, earlier_files = wire
        return RankWrites(files, WrittenPieces.from_wire(pieces), [ValueRecord.from_wire(v) for v in values],
                          used_pickle, used_refs, WrittenPieces.from_wire(reused), earlier_files)
