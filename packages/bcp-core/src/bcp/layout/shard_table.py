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
    crcs      uint32[crc_first[count]]

Each tensor's shards are one contiguous row range ``[first, first + count)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from bcp.layout.box import Box


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Where bytes lie: ``files[file]`` from ``offset``, ``nbytes`` long, with one crc32c per chunk."""

    file: int
    offset: int
    nbytes: int
    crcs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ShardEntry:
    box: Box
    bytes: ByteRange


class ShardTable:
    """Columns of shard rows (see the module docstring)."""

    def __init__(self, offsets: np.ndarray, lengths: np.ndarray, file: np.ndarray, offset: np.ndarray,
                 nbytes: np.ndarray, crc_first: np.ndarray, crcs: np.ndarray) -> None:
        self.offsets, self.lengths = offsets, lengths
        self.file, self.offset, self.nbytes = file, offset, nbytes
        self.crc_first, self.crcs = crc_first, crcs

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
        crcs = self.crcs[np.repeat(crc_lo - ends + counts, counts) + np.arange(total)].tolist()
        bounds = [0, *ends.tolist()]
        return [ShardEntry(Box(tuple(o[:d]), tuple(n[:d])),
                           ByteRange(f, s, b, tuple(crcs[bounds[i]:bounds[i + 1]])))
                for i, (o, n, d, f, s, b) in enumerate(zip(offsets, lengths, ndims, files, starts, sizes))]

    def encode(self) -> bytes:
        return b"".join(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes() for a in
                        (self.offsets, self.lengths, self.file, self.offset, self.nbytes, self.crc_first, self.crcs))

    @staticmethod
    def decode(data: bytes, count: int, ndim: int) -> "ShardTable":
        """Columns viewed from ``data``; ``ValueError`` if its size does not match ``count``/``ndim``."""
        i64 = np.dtype("<i8")
        fixed = (2 * count * ndim + 3 * count + count + 1) * 8
        if count < 0 or ndim < 0 or len(data) < fixed or (len(data) - fixed) % 4:
            raise ValueError(f"shard table of {len(data)} bytes cannot hold {count} rows of {ndim} dims")
        buffer, at = memoryview(data), 0

        def take(n: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
            nonlocal at
            array = np.frombuffer(buffer, dtype=dtype, count=n, offset=at).reshape(shape)
            at += n * dtype.itemsize
            return array

        offsets = take(count * ndim, i64, (count, ndim))
        lengths = take(count * ndim, i64, (count, ndim))
        file, offset, nbytes = take(count, i64, (count,)), take(count, i64, (count,)), take(count, i64, (count,))
        crc_first = take(count + 1, i64, (count + 1,))
        crcs = take((len(data) - fixed) // 4, np.dtype("<u4"), ((len(data) - fixed) // 4,))
        return ShardTable(offsets, lengths, file, offset, nbytes, crc_first, crcs)

    @staticmethod
    def from_entries(groups: Iterable[list[ShardEntry]], ndim: int) -> "ShardTable":
        """A table of the given entries, group after group (each group one tensor's shards)."""
        entries = [e for group in groups for e in group]
        count = len(entries)
        offsets = np.zeros((count, ndim), dtype=np.int64)
        lengths = np.ones((count, ndim), dtype=np.int64)
        for i, e in enumerate(entries):
            offsets[i, :e.box.ndim] = e.box.offsets
            lengths[i, :e.box.ndim] = e.box.lengths
        counts = np.array([len(e.bytes.crcs) for e in entries], dtype=np.int64)
        return ShardTable(
            offsets, lengths,
            np.array([e.bytes.file for e in entries], dtype=np.int64),
            np.array([e.bytes.offset for e in entries], dtype=np.int64),
            np.array([e.bytes.nbytes for e in entries], dtype=np.int64),
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            np.array([c for e in entries for c in e.bytes.crcs], dtype=np.uint32))
