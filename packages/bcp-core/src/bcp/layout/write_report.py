"""What a rank wrote: its data files and where each piece and value record lies in them, with the
chunk checksums, and the pieces it did not write because an earlier generation stores their bytes
(an incremental save's). The coordinator assembles the manifest from every rank's report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from bcp.wire_records import WireRecord, list_of

if TYPE_CHECKING:
    from bcp.layout.write_plan import PieceWrite


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

    #: The layout of :meth:`to_wire`: each column's bytes by name.
    VERSION = 1

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.VERSION, "index": self.index.tobytes(), "parts": self.parts,
                "where": self.where.tobytes(), "crc_counts": self.crc_counts.tobytes(), "crcs": self.crcs.tobytes()}

    @staticmethod
    def from_wire(wire: dict[str, Any]) -> "WrittenPieces":
        return WrittenPieces(np.frombuffer(wire["index"], dtype=np.int64), wire["parts"],
                             np.frombuffer(wire["where"], dtype=np.int64).reshape(-1, 3),
                             np.frombuffer(wire["crc_counts"], dtype=np.int64),
                             np.frombuffer(wire["crcs"], dtype=np.uint32))

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

    @staticmethod
    def of(write: "PieceWrite", file: int, offset: int, nbytes: int, crcs: list[int]) -> "PieceRecord":
        """Where ``write``'s bytes lie: ``nbytes`` at ``offset`` of the rank's file ``file``."""
        part = write.part
        return PieceRecord(write.index, part.offsets if part else None, part.lengths if part else None, file, offset,
                           nbytes, crcs)


@dataclass(slots=True)
class ValueRecord(WireRecord):
    """Where the writer put a value's record; ``ranks`` as in ``write_plan.ValueWrite``."""

    name: str
    file: int
    offset: int
    nbytes: int
    tree_nbytes: int
    crcs: list[int]
    ranks: list[int] | None = None


@dataclass(slots=True)
class RankWrites(WireRecord):
    """One rank's report: the files it wrote (names relative to the generation), its pieces and
    value records in them, whether any value was pickled and whether any record refers to tensors
    saved beside it; and the pieces whose bytes ``reused`` it did not write, in data files of earlier
    generations (``earlier_files``, named from the checkpoint path: ``layout.references``)."""

    NESTED = {"pieces": WrittenPieces.from_wire, "values": list_of(ValueRecord.from_wire),
              "reused": WrittenPieces.from_wire}
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
