"""What a rank wrote: its data files and where each piece and value record lies in them, with the
chunk checksums, and the pieces it did not write because an earlier generation stores their bytes
(an incremental save's). The coordinator assembles the manifest from every rank's report."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from bcp.layout.shard_table import ChunkColumns, StoredChunks
from bcp.wire_records import WireRecord, list_of

if TYPE_CHECKING:
    from bcp.layout.write_plan import PieceWrite


@dataclass(slots=True)
class WrittenPieces:
    """A rank's written pieces as columns: the local piece ``index`` of each (``parts`` lists
    ``[row, offsets, lengths]`` for rows that are part of a split piece), ``where`` = file index,
    byte offset and (raw) byte length, and each row's ``crc_counts`` chunk checksums in ``crcs``.
    ``chunks``: where the rank compressed, every row's stored chunks (the shard table's columns of
    format version 4), else None."""

    index: np.ndarray
    parts: list[list[Any]]
    where: np.ndarray
    crc_counts: np.ndarray
    crcs: np.ndarray
    chunks: ChunkColumns | None = None

    #: The layout of :meth:`to_wire`: each column's bytes by name (``chunks``' columns under their
    #: names, absent where None).
    VERSION = 1

    def to_wire(self) -> dict[str, Any]:
        wire = {"version": self.VERSION, "index": self.index.tobytes(), "parts": self.parts,
                "where": self.where.tobytes(), "crc_counts": self.crc_counts.tobytes(), "crcs": self.crcs.tobytes()}
        if self.chunks is not None:
            wire.update(zip(_CHUNK_COLUMNS, (a.tobytes() for a in self.chunks.arrays())))
        return wire

    @staticmethod
    def from_wire(wire: dict[str, Any]) -> "WrittenPieces":
        chunks = None
        if all(name in wire for name in _CHUNK_COLUMNS):
            chunks = ChunkColumns(*(np.frombuffer(wire[name], dtype=dtype) for name, dtype in _CHUNK_COLUMNS.items()))
        return WrittenPieces(np.frombuffer(wire["index"], dtype=np.int64), wire["parts"],
                             np.frombuffer(wire["where"], dtype=np.int64).reshape(-1, 3),
                             np.frombuffer(wire["crc_counts"], dtype=np.int64),
                             np.frombuffer(wire["crcs"], dtype=np.uint32), chunks)

    @property
    def stored_nbytes(self) -> int:
        """The bytes these rows take in their files."""
        return int((self.where[:, 2] if self.chunks is None else self.chunks.stored_nbytes).sum())

    def with_chunks(self, chunk: int) -> "WrittenPieces":
        """These rows with stored chunks (``chunk``-byte chunks; raw ones where the rank had none)."""
        if self.chunks is not None:
            return self
        crc_first = np.concatenate([[0], np.cumsum(self.crc_counts)]).astype(np.int64)
        return replace(self, chunks=ChunkColumns.raw(self.where[:, 2], crc_first, self.crcs, chunk))

    @staticmethod
    def empty() -> "WrittenPieces":
        return WrittenPieces.of([])

    @staticmethod
    def concat(first: "WrittenPieces", second: "WrittenPieces", second_files: np.ndarray) -> "WrittenPieces":
        """``first``'s rows, then ``second``'s with file ``i`` renamed ``second_files[i]`` (both with
        stored chunks, or neither: ``with_chunks``)."""
        where = second.where.copy()
        where[:, 0] = second_files[where[:, 0]] if len(where) else where[:, 0]
        shift = len(first.index)
        chunks = None
        if first.chunks is not None and second.chunks is not None:
            chunks = ChunkColumns(*(np.concatenate(pair) for pair in zip(first.chunks.arrays(), second.chunks.arrays())))
        elif first.chunks is not None or second.chunks is not None:
            raise ValueError("written pieces with stored chunks joined to pieces without")
        return WrittenPieces(np.concatenate([first.index, second.index]),
                             first.parts + [[row + shift, offsets, lengths] for row, offsets, lengths in second.parts],
                             np.concatenate([first.where, where]), np.concatenate([first.crc_counts, second.crc_counts]),
                             np.concatenate([first.crcs, second.crcs]), chunks)

    @staticmethod
    def of(rows: list["PieceRecord"]) -> "WrittenPieces":
        """The rows as columns: with stored chunks where every row has them (a compressing writer's),
        without where none has."""
        stored = [r.stored for r in rows if r.stored is not None]
        if stored and len(stored) != len(rows):
            raise ValueError("written pieces with stored chunks mixed with pieces without")
        chunks = None
        if stored:
            chunks = ChunkColumns(np.array([sum(s.nbytes) for s in stored], dtype=np.int64),
                                  np.array([n for s in stored for n in s.nbytes], dtype=np.int64),
                                  np.array([c for s in stored for c in s.crcs], dtype=np.uint32),
                                  np.array([c for s in stored for c in s.codecs], dtype=np.uint8))
        return WrittenPieces(
            index=np.array([r.index for r in rows], dtype=np.int64),
            parts=[[i, list(r.part_offsets), list(r.part_lengths)] for i, r in enumerate(rows)
                   if r.part_offsets is not None],
            where=np.array([(r.file, r.offset, r.nbytes) for r in rows], dtype=np.int64).reshape(-1, 3),
            crc_counts=np.array([len(r.crcs) for r in rows], dtype=np.int64),
            crcs=np.array([c for r in rows for c in r.crcs], dtype=np.uint32),
            chunks=chunks)


#: The wire names and dtypes of ``ChunkColumns``' arrays, in their order.
_CHUNK_COLUMNS = {"stored_nbytes": np.int64, "chunk_stored": np.int64, "stored_crcs": np.uint32,
                  "chunk_codec": np.uint8}


@dataclass(slots=True)
class PieceRecord:
    """Where the writer put local piece ``index`` (or the part of it given by ``part_*``): ``nbytes``
    raw bytes with chunk checksums ``crcs``, at ``offset`` of file ``file``; ``stored``: how its
    chunks lie there where the writer compressed (None: as they are)."""

    index: int
    part_offsets: tuple[int, ...] | None
    part_lengths: tuple[int, ...] | None
    file: int
    offset: int
    nbytes: int
    crcs: list[int]
    stored: StoredChunks | None = None

    @staticmethod
    def of(write: "PieceWrite", file: int, offset: int, nbytes: int, crcs: list[int],
           stored: StoredChunks | None = None) -> "PieceRecord":
        """Where ``write``'s bytes lie: ``nbytes`` at ``offset`` of the rank's file ``file``."""
        part = write.part
        return PieceRecord(write.index, part.offsets if part else None, part.lengths if part else None, file, offset,
                           nbytes, crcs, stored)


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
        """Bytes written (not those reused), as stored."""
        return self.pieces.stored_nbytes + sum(v.nbytes for v in self.values)

    @property
    def reused_nbytes(self) -> int:
        return self.reused.stored_nbytes
