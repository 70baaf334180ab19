"""Incremental saves: which of the pieces a rank writes are stored already, byte for byte, by the
newest committed generation of the checkpoint path (its *base*), so that the new generation's shard
rows refer to those bytes instead of writing them again (``layout.references``).

Every box of a tensor has one writer in the global plan, and that rank alone decides for it. A
piece is *reused* only where the base stores the same box (name, dtype, global shape, offsets,
lengths) and one of these holds, tried in order:

1. *Frozen and untouched* (1/16 of its bytes read): the piece lies in a parameter with
   ``requires_grad=False``; this process captured it when it saved the base (the memory below),
   and its storage, address, dtype, shape, strides, device and torch's version counter are as they
   were then; and the 1 MiB chunks this save checks (:func:`checked_chunks`: every chunk within
   ``FROZEN_CHECK_SAVES`` saves) still have their stored checksums. Every
   in-place operation on the parameter or a view of it moves the counter; ``.data =`` and ``set_``
   give it other memory. Writes that bypass the counter (through ``.data``, a NumPy view, a
   collective or a custom kernel writing into it) are seen only where they touch a chunk checked.
2. *The same checksums*: the crc32c of each 1 MiB chunk of its bytes equals the stored one (bytes
   that changed escape this with a chance of 2**-32 per changed chunk). The checksums computed are
   those the writer then stores for a piece that is written.

A piece this process captured at the base whose version counter moved since (its memory the same)
is written without reading it: it was changed in place. Everything else is written. What this
process captured is kept by ``planning.reuse_memory``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

from bcp.chunk_codecs import RAW
from bcp.engine.bytes_of import byte_view, host_contiguous
from bcp.engine.checksum import chunk_crcs
from bcp.layout.box import Box
from bcp.layout.dtypes import dtype_name
from bcp.layout.manifest import Manifest
from bcp.layout.piece import Piece
from bcp.layout.references import earlier_file
from bcp.layout.shard_table import StoredChunks, raw_chunk_lengths
from bcp.layout.shards import is_dtensor
from bcp.layout.write_plan import PieceWrite
from bcp.layout.write_report import PieceRecord, RankWrites, WrittenPieces
from bcp.torch_internals.tensors import version_counter

#: A box of a tensor: name, dtype name, global shape, box offsets, box lengths.
Key = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class Stored:
    """A box's bytes as a committed generation stores them: ``file`` named from the checkpoint path
    (``gen-<n>/data/...``), ``nbytes`` raw bytes from ``offset``, one crc32c per chunk of them, and
    how the chunks lie where some are compressed (``stored``: referred to as they are, never
    compressed again)."""

    file: str
    offset: int
    nbytes: int
    crcs: tuple[int, ...]
    stored: StoredChunks | None = None


@dataclass(frozen=True, slots=True)
class Seen:
    """A tensor's memory and version counter when a save captured its bytes."""

    storage: int
    address: int
    version: int
    layout: tuple[Any, ...]

    @staticmethod
    def of(tensor: torch.Tensor) -> "Seen":
        address = tensor.data_ptr()  # the storage's own address follows, without making its Python object
        return Seen(address - tensor.storage_offset() * tensor.element_size(), address, version_counter(tensor),
                    (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.device))

    def same_memory(self, other: "Seen") -> bool:
        return (self.storage, self.address, self.layout) == (other.storage, other.address, other.layout)


@dataclass(frozen=True, slots=True)
class Remembered:
    """A box stored by a generation, and (where this process captured it) the tensor as seen then."""

    stored: Stored
    seen: Seen | None = None


class FrozenParameters:
    """The memory of the parameters with ``requires_grad=False`` of a state's modules (a DTensor's
    local shard), to tell whether a piece lies inside one."""

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        self._ranges = sorted(ranges)
        self._starts = [start for start, _ in self._ranges]

    @staticmethod
    def of(modules: Iterable[torch.nn.Module]) -> "FrozenParameters":
        ranges = []
        for module in modules:
            for parameter in module.parameters():
                if parameter.requires_grad:
                    continue
                local = parameter.to_local() if is_dtensor(parameter) else parameter
                if local.numel() and local.is_contiguous():
                    ranges.append((local.data_ptr(), local.data_ptr() + local.numel() * local.element_size()))
        return FrozenParameters(ranges)

    def holds(self, tensor: torch.Tensor) -> bool:
        if not tensor.is_contiguous():
            return False
        start = tensor.data_ptr()
        at = bisect.bisect_right(self._starts, start) - 1
        return at >= 0 and start + tensor.numel() * tensor.element_size() <= self._ranges[at][1]


def key_of(piece: Piece, box: Box) -> Key:
    return piece.name, dtype_name(piece.dtype), tuple(piece.global_shape), box.offsets, box.lengths


def stored_boxes(manifest: Manifest, names: set[str]) -> dict[Key, Remembered]:
    """The boxes of the tensors ``names`` that ``manifest`` (a committed generation's) stores."""
    out: dict[Key, Remembered] = {}
    for name in names:
        entry = manifest.tensors.get(name)
        if entry is None:
            continue
        shape = tuple(entry.shape)
        for shard in entry.shards:
            where = shard.bytes
            out[(name, entry.dtype, shape, shard.box.offsets, shard.box.lengths)] = Remembered(Stored(
                earlier_file(manifest.generation, manifest.files[where.file]), where.offset, where.nbytes, where.crcs,
                where.stored))
    return out


@dataclass(slots=True)
class Reuse:
    """A rank's share split into the pieces it writes and those an earlier generation stores."""

    written: list[PieceWrite]
    reused: list[tuple[PieceWrite, Stored]]
    #: Every piece's box and how its tensor was seen, for the memory of this save.
    seen: dict[tuple[int, tuple[int, ...] | None], tuple[Key, Seen]]
    #: The checksum chunk's size.
    chunk: int

    @property
    def reused_nbytes(self) -> int:
        return sum(write.nbytes for write, _ in self.reused)

    def complete(self, report: RankWrites) -> None:
        """Add the reused pieces to the rank's report (where their bytes lie, their checksums, their
        stored chunks: where any reused box has compressed chunks, every row lists its chunks)."""
        files: dict[str, int] = {}
        compressed = any(stored.stored is not None for _, stored in self.reused)
        rows = [PieceRecord.of(write, files.setdefault(stored.file, len(files)), stored.offset, stored.nbytes,
                               list(stored.crcs), _chunks_of(stored, self.chunk) if compressed else None)
                for write, stored in self.reused]
        report.reused, report.earlier_files = WrittenPieces.of(rows), list(files)

    def remembered(self, report: RankWrites, generation_folder: str) -> dict[Key, Remembered]:
        """Every box of the report (its own files in ``generation_folder``) with the tensor as seen."""
        out: dict[Key, Remembered] = {}
        for rows, files in ((report.pieces, [f"{generation_folder}/{f}" for f in report.files]),
                            (report.reused, report.earlier_files)):
            parts = {row: tuple(offsets) for row, offsets, _ in rows.parts}
            crcs = rows.crcs.tolist()
            ends = np.cumsum(rows.crc_counts).tolist()
            chunks = _stored_chunks(rows, ends)
            for row, (index, (file, offset, nbytes), end, count) in enumerate(zip(
                    rows.index.tolist(), rows.where.tolist(), ends, rows.crc_counts.tolist())):
                key, seen = self.seen[(index, parts.get(row))]
                out[key] = Remembered(Stored(files[file], offset, nbytes, tuple(crcs[end - count:end]), chunks[row]),
                                      seen)
        return out


def decide(writes: list[PieceWrite], pieces: list[Piece], base: dict[Key, Remembered],
           frozen: FrozenParameters | None, generation: int, chunk: int) -> Reuse:
    """Which of ``writes`` (this rank's share, views of ``pieces``) the base stores (``base``: its
    boxes, with how this process saw them where it captured them). ``frozen`` is None where the
    first signal is not trusted."""
    written: list[PieceWrite] = []
    reused: list[tuple[PieceWrite, Stored]] = []
    seen: dict[tuple[int, tuple[int, ...] | None], tuple[Key, Seen]] = {}
    for write in writes:
        piece = pieces[write.index]
        box = Box(write.part.offsets, write.part.lengths) if write.part is not None else piece.box
        key, tensor = key_of(piece, box), write.tensor()
        now = Seen.of(tensor)
        seen[(write.index, write.part.offsets if write.part is not None else None)] = (key, now)
        known = base.get(key)
        if known is None or known.stored.nbytes != write.nbytes:
            written.append(write)
        elif known.seen is not None and known.seen.same_memory(now) and known.seen.version != now.version:
            written.append(write)  # changed in place since the save that stored it
        elif (frozen is not None and known.seen == now and frozen.holds(tensor)
              and all(_chunk_matches(tensor, known.stored.crcs, index, chunk)
                      for index in checked_chunks(generation, len(known.stored.crcs)))):
            reused.append((write, known.stored))
        else:
            crcs = write.crcs if write.crcs is not None else chunk_crcs(byte_view(host_contiguous(tensor)), chunk)
            if tuple(crcs) == known.stored.crcs:
                reused.append((write, known.stored))
            else:
                written.append(PieceWrite(write.index, write.part, write.data, write.nbytes, list(crcs)))
    return Reuse(written, reused, seen, chunk)


def _chunks_of(stored: Stored, chunk: int) -> StoredChunks:
    """How ``stored``'s chunks lie: as recorded, or raw (``chunk``-byte chunks) where none is compressed."""
    if stored.stored is not None:
        return stored.stored
    lengths = raw_chunk_lengths(np.array([stored.nbytes]), np.array([0, len(stored.crcs)]), chunk)
    return StoredChunks((RAW,) * len(stored.crcs), tuple(lengths.tolist()), stored.crcs)


def _stored_chunks(rows: WrittenPieces, ends: list[int]) -> list[StoredChunks | None]:
    """Each row's stored chunks where some of them are compressed (else None), from the report's columns."""
    if rows.chunks is None:
        return [None] * len(rows.index)
    codecs, lengths = rows.chunks.chunk_codec.tolist(), rows.chunks.chunk_stored.tolist()
    crcs = rows.chunks.stored_crcs.tolist()
    starts = [0, *ends]
    return [StoredChunks(tuple(codecs[lo:hi]), tuple(lengths[lo:hi]), tuple(crcs[lo:hi]))
            if any(codecs[lo:hi]) else None for lo, hi in zip(starts, starts[1:])]


#: Every checksum chunk of a frozen, untouched tensor is checked within this many consecutive saves
#: (each save checks every FROZEN_CHECK_SAVES-th chunk, from its own starting point; a tensor of
#: fewer chunks, one chunk per save, each within as many saves as it has chunks), so a write that
#: torch's version counter does not see (through ``.data``) reaches the checkpoint within as many
#: saves, whatever the tensor's size. Each save checksums 1/16 of the frozen bytes: crc32c ran at
#: 13.6 GB/s on one CPU core (64 MiB in 4.6 ms), so a 14 GB frozen base costs about 65 ms a save.
FROZEN_CHECK_SAVES = 16


def checked_chunks(generation: int, chunks: int) -> range:
    """The checksum chunks of a frozen tensor of ``chunks`` chunks that the save of ``generation`` checks."""
    step = max(1, min(FROZEN_CHECK_SAVES, chunks))
    return range(generation % step, chunks, step)


def _chunk_matches(tensor: torch.Tensor, crcs: tuple[int, ...], index: int, chunk: int) -> bool:
    """Whether chunk ``index`` of the (contiguous) tensor's bytes has checksum ``crcs[index]``; only
    that chunk is read (copied off a device)."""
    if tensor.device.type == "cpu":
        return chunk_crcs(byte_view(tensor)[index * chunk:(index + 1) * chunk], chunk) == [crcs[index]]
    per = chunk // tensor.element_size()
    return chunk_crcs(byte_view(host_contiguous(tensor.reshape(-1)[index * per:(index + 1) * per])),
                      chunk) == [crcs[index]]
