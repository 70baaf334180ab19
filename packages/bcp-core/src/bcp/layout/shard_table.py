"""The shard table: every tensor shard of a checkpoint as fixed-width numeric columns.

A checkpoint can hold millions of shards; as JSON rows they take seconds to parse, as columns they
load with one ``frombuffer`` and are validated with array operations. ``shard_table.bin`` holds,
little-endian and in this order, for ``count`` shards and ``ndim`` columns per box:

    offsets   int64[count][ndim]   box offsets (unused trailing columns: 0)
    lengths   int64[count][ndim]   box lengths (unused trailing columns: 1)
    file      int64[count]         index into the manifest's ``files``
    offset    int64[count]         byte offset of the shard in that file
    nbytes    int64[count]         byte length of the shard
    crc_first int64[count + 1]     shard i's checksums are crcs[crc_first[i]:crc_first[i+1]]
    crcs      uint32[crc_first[count]]   crc32c of each chunk's raw bytes

and from format version 4 (compressed chunks), one value per chunk after ``stored_nbytes``:

    stored_nbytes int64[count]             the shard's bytes in its file
    chunk_stored  int64[crc_first[count]]  each chunk's stored length
    stored_crcs   uint32[crc_first[count]] crc32c of each chunk's stored bytes
    chunk_codec   uint8[crc_first[count]]  each chunk's codec (``chunk_codecs``: 0 = raw)

Each tensor's shards are one contiguous row range ``[first, first + count)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from bcp.layout.box import Box


@dataclass(frozen=True, slots=True)
class StoredChunks:
    """How the chunks of a range lie in its file where any of them is compressed: per chunk, its
    codec (``chunk_codecs``; 0: raw), its stored length and the crc32c of its stored bytes. Chunk j
    starts ``sum(nbytes[:j])`` bytes after the range's offset."""

    codecs: tuple[int, ...]
    nbytes: tuple[int, ...]
    crcs: tuple[int, ...]

    def starts(self) -> list[int]:
        """Where each chunk starts, from the range's offset, and where the last one ends."""
        return [0, *accumulate(self.nbytes)]


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Where bytes lie: ``files[file]`` from ``offset``, ``nbytes`` long, with one crc32c per chunk
    of those (raw) bytes; ``stored`` where some chunks are compressed (None: stored as they are)."""

    file: int
    offset: int
    nbytes: int
    crcs: tuple[int, ...]
    stored: StoredChunks | None = None

    @property
    def stored_nbytes(self) -> int:
        """The range's bytes in its file."""
        return self.nbytes if self.stored is None else sum(self.stored.nbytes)


@dataclass(frozen=True, slots=True)
class ShardEntry:
    box: Box
    bytes: ByteRange


@dataclass(slots=True)
class ChunkColumns:
    """The columns of format version 4: each row's stored length, and per chunk (aligned with
    ``crcs``) its stored length, the crc32c of its stored bytes and its codec."""

    stored_nbytes: np.ndarray
    chunk_stored: np.ndarray
    stored_crcs: np.ndarray
    chunk_codec: np.ndarray

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.stored_nbytes, self.chunk_stored, self.stored_crcs, self.chunk_codec

    @staticmethod
    def raw(nbytes: np.ndarray, crc_first: np.ndarray, crcs: np.ndarray, chunk: int) -> "ChunkColumns":
        """The columns of rows whose chunks are all stored raw (``chunk``-byte chunks)."""
        return ChunkColumns(nbytes.astype(np.int64), raw_chunk_lengths(nbytes, crc_first, chunk), crcs.copy(),
                            np.zeros(len(crcs), dtype=np.uint8))


def raw_chunk_lengths(nbytes: np.ndarray, crc_first: np.ndarray, chunk: int) -> np.ndarray:
    """Each chunk's raw length, for rows of ``nbytes`` bytes whose chunks start at ``crc_first``."""
    counts = np.diff(crc_first)
    index = np.arange(int(crc_first[-1]), dtype=np.int64) - np.repeat(crc_first[:-1], counts)
    return np.clip(np.repeat(nbytes, counts) - index * chunk, 0, chunk).astype(np.int64)


class ShardTable:
    """Columns of shard rows (see the module docstring); ``chunks`` from format version 4."""

    def __init__(self, offsets: np.ndarray, lengths: np.ndarray, file: np.ndarray, offset: np.ndarray,
                 nbytes: np.ndarray, crc_first: np.ndarray, crcs: np.ndarray,
                 chunks: ChunkColumns | None = None) -> None:
        self.offsets, self.lengths = offsets, lengths
        self.file, self.offset, self.nbytes = file, offset, nbytes
        self.crc_first, self.crcs = crc_first, crcs
        self.chunks = chunks

    @property
    def count(self) -> int:
        return len(self.file)

    @property
    def ndim(self) -> int:
        return self.offsets.shape[1]

    def rows(self, first: int, count: int, ndim: int) -> list[ShardEntry]:
        """Rows ``[first, first + count)`` as entries, boxes cut to ``ndim`` dimensions."""
        return self.entries(np.arange(first, first + count), [ndim] * count)

    def entries(self, rows: np.ndarray, ndims: Sequence[int]) -> list[ShardEntry]:
        """The given rows as entries, row ``rows[i]``'s box cut to ``ndims[i]`` dimensions."""
        offsets, lengths = self.offsets[rows].tolist(), self.lengths[rows].tolist()
        files, starts, sizes = self.file[rows].tolist(), self.offset[rows].tolist(), self.nbytes[rows].tolist()
        crc_lo, crc_hi = self.crc_first[rows], self.crc_first[rows + 1]
        # Every row's checksums gathered in one array operation, then cut per row.
        counts = crc_hi - crc_lo
        ends = np.cumsum(counts)
        total = int(ends[-1]) if len(ends) else 0
        gather = np.repeat(crc_lo - ends + counts, counts) + np.arange(total)
        crcs = self.crcs[gather].tolist()
        bounds = [0, *ends.tolist()]
        stored = self._stored_chunks(rows, gather, bounds)
        return [ShardEntry(Box(tuple(o[:d]), tuple(n[:d])),
                           ByteRange(f, s, b, tuple(crcs[bounds[i]:bounds[i + 1]]), stored[i]))
                for i, (o, n, d, f, s, b) in enumerate(zip(offsets, lengths, ndims, files, starts, sizes))]

    def _stored_chunks(self, rows: np.ndarray, gather: np.ndarray, bounds: list[int]) -> list[StoredChunks | None]:
        """Each row's stored chunks; None for a row whose chunks are all raw (read as before version 4)."""
        if self.chunks is None or not len(rows):
            return [None] * len(rows)
        codecs = self.chunks.chunk_codec[gather]
        compressed = np.maximum.reduceat(codecs, bounds[:-1]) > 0  # every row has at least one chunk
        codecs, stored = codecs.tolist(), self.chunks.chunk_stored[gather].tolist()
        stored_crcs = self.chunks.stored_crcs[gather].tolist()
        return [StoredChunks(tuple(codecs[lo:hi]), tuple(stored[lo:hi]), tuple(stored_crcs[lo:hi])) if keep else None
                for keep, lo, hi in zip(compressed.tolist(), bounds, bounds[1:])]

    def encode(self) -> bytes:
        columns = (self.offsets, self.lengths, self.file, self.offset, self.nbytes, self.crc_first, self.crcs)
        if self.chunks is not None:
            columns += self.chunks.arrays()
        return b"".join(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes() for a in columns)

    @staticmethod
    def decode(data: bytes, count: int, ndim: int, chunk_columns: bool = False) -> "ShardTable":
        """Columns viewed from ``data`` (with the columns of compressed chunks where
        ``chunk_columns``); ``ValueError`` if its size does not match ``count``/``ndim``."""
        i64 = np.dtype("<i8")
        fixed = (2 * count * ndim + 3 * count + count + 1 + (count if chunk_columns else 0)) * 8
        per_chunk = 4 + (8 + 4 + 1 if chunk_columns else 0)
        if count < 0 or ndim < 0 or len(data) < fixed or (len(data) - fixed) % per_chunk:
            raise ValueError(f"shard table of {len(data)} bytes cannot hold {count} rows of {ndim} dims")
        buffer, at = memoryview(data), 0
        nchunks = (len(data) - fixed) // per_chunk

        def take(n: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
            nonlocal at
            array = np.frombuffer(buffer, dtype=dtype, count=n, offset=at).reshape(shape)
            at += n * dtype.itemsize
            return array

        offsets = take(count * ndim, i64, (count, ndim))
        lengths = take(count * ndim, i64, (count, ndim))
        file, offset, nbytes = take(count, i64, (count,)), take(count, i64, (count,)), take(count, i64, (count,))
        crc_first = take(count + 1, i64, (count + 1,))
        crcs = take(nchunks, np.dtype("<u4"), (nchunks,))
        chunks = None
        if chunk_columns:
            chunks = ChunkColumns(take(count, i64, (count,)), take(nchunks, i64, (nchunks,)),
                                  take(nchunks, np.dtype("<u4"), (nchunks,)), take(nchunks, np.dtype("u1"), (nchunks,)))
        return ShardTable(offsets, lengths, file, offset, nbytes, crc_first, crcs, chunks)

    @staticmethod
    def from_entries(groups: Iterable[list[ShardEntry]], ndim: int, chunk: int) -> "ShardTable":
        """A table of the given entries, group after group (each group one tensor's shards), their
        checksums over ``chunk``-byte chunks."""
        entries = [e for group in groups for e in group]
        count = len(entries)
        offsets = np.zeros((count, ndim), dtype=np.int64)
        lengths = np.ones((count, ndim), dtype=np.int64)
        for i, e in enumerate(entries):
            offsets[i, :e.box.ndim] = e.box.offsets
            lengths[i, :e.box.ndim] = e.box.lengths
        counts = np.array([len(e.bytes.crcs) for e in entries], dtype=np.int64)
        nbytes = np.array([e.bytes.nbytes for e in entries], dtype=np.int64)
        crc_first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        crcs = np.array([c for e in entries for c in e.bytes.crcs], dtype=np.uint32)
        return ShardTable(
            offsets, lengths,
            np.array([e.bytes.file for e in entries], dtype=np.int64),
            np.array([e.bytes.offset for e in entries], dtype=np.int64),
            nbytes, crc_first, crcs, _chunk_columns([e.bytes for e in entries], chunk))


def _chunk_columns(ranges: list[ByteRange], chunk: int) -> ChunkColumns | None:
    """The version-4 columns of ``ranges`` (``chunk``-byte chunks), None where none is compressed."""
    if all(r.stored is None for r in ranges):
        return None
    codecs, stored, crcs = [], [], []
    for r in ranges:
        if r.stored is None:
            codecs += [0] * len(r.crcs)
            stored += [min(chunk, max(0, r.nbytes - i * chunk)) for i in range(len(r.crcs))]
            crcs += r.crcs
        else:
            codecs += r.stored.codecs
            stored += r.stored.nbytes
            crcs += r.stored.crcs
    return ChunkColumns(np.array([r.stored_nbytes for r in ranges], dtype=np.int64), np.array(stored, dtype=np.int64),
                        np.array(crcs, dtype=np.uint32), np.array(codecs, dtype=np.uint8))
