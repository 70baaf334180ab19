"""Writing one rank's share of a checkpoint: pieces and value records into data files, with chunk
checksums, several files in parallel (one writer thread per file), from tensor memory directly."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from bcp.engine.bytes_of import byte_view, host_contiguous
from bcp.engine.checksum import chunk_crcs
from bcp.engine.location import Location, data_file_name
from bcp.errors import StorageError
from bcp.layout.box import Box
from bcp.layout.values import EncodedValue
from bcp.planning.pieces import Piece

# Below this many bytes per file, another file (and writer thread) costs more than it saves.
MIN_BYTES_PER_FILE = 32 << 20


@dataclass(slots=True)
class PieceWrite:
    """A piece to write: ``spec`` is the plan's entry (a piece index, or ``[index, offsets,
    lengths]`` for part of a split piece), ``tensor`` the bytes to write (shaped like the part)."""

    spec: Any
    tensor: torch.Tensor


def piece_writes(pieces: list[Piece], specs: list[Any]) -> list[PieceWrite]:
    """The plan's write entries resolved to tensors (views of the pieces, no copy)."""
    out = []
    for spec in specs:
        if isinstance(spec, int):
            out.append(PieceWrite(spec, pieces[spec].tensor))
        else:
            piece = pieces[spec[0]]
            part = Box(tuple(spec[1]), tuple(spec[2])).relative_to(piece.box)
            out.append(PieceWrite(spec, piece.tensor[part.slices()]))
    return out


@dataclass
class RankWrites:
    """What a rank wrote: file names, per piece ``[spec, file index, offset, nbytes, crcs]``, per
    value ``[name, file index, offset, nbytes, tree nbytes, crcs]``, and whether any value was
    pickled. It travels to the coordinator as ``to_wire()`` (piece rows as integer columns)."""

    files: list[str] = field(default_factory=list)
    pieces: list[list] = field(default_factory=list)
    objects: list[list] = field(default_factory=list)
    used_pickle: bool = False

    def to_wire(self) -> list:
        specs = [row[0] for row in self.pieces]
        columns = WrittenPieces(
            index=np.array([s if isinstance(s, int) else s[0] for s in specs], dtype=np.int64),
            parts=[[i, s[1], s[2]] for i, s in enumerate(specs) if not isinstance(s, int)],
            where=np.array([row[1:4] for row in self.pieces], dtype=np.int64).reshape(-1, 3),
            crc_counts=np.array([len(row[4]) for row in self.pieces], dtype=np.int64),
            crcs=np.array([c for row in self.pieces for c in row[4]], dtype=np.uint32))
        return [self.files, columns.to_wire(), self.objects, self.used_pickle]

    @property
    def nbytes(self) -> int:
        return sum(row[3] for row in self.pieces + self.objects)


@dataclass
class WrittenPieces:
    """A rank's written pieces as columns: the local piece ``index`` of each (``parts`` lists
    ``[row, offsets, lengths]`` for rows that are part of a split piece), ``where`` = file index,
    byte offset and byte length, and each row's ``crc_counts`` chunk checksums in ``crcs``."""

    index: np.ndarray
    parts: list[list]
    where: np.ndarray
    crc_counts: np.ndarray
    crcs: np.ndarray

    def to_wire(self) -> list:
        return [self.index.tobytes(), self.parts, self.where.tobytes(), self.crc_counts.tobytes(),
                self.crcs.tobytes()]

    @staticmethod
    def from_wire(wire: list) -> "WrittenPieces":
        index, parts, where, crc_counts, crcs = wire
        return WrittenPieces(np.frombuffer(index, dtype=np.int64), parts,
                             np.frombuffer(where, dtype=np.int64).reshape(-1, 3),
                             np.frombuffer(crc_counts, dtype=np.int64), np.frombuffer(crcs, dtype=np.uint32))


@dataclass(slots=True)
class _Item:
    nbytes: int
    piece: PieceWrite | None = None
    name: str = ""
    value: EncodedValue | None = None


def write_rank(location: Location, generation: int, rank: int, pieces: list[PieceWrite],
               objects: list[tuple[str, EncodedValue]], threads: int, chunk: int) -> RankWrites:
    items = [_Item(p.tensor.nbytes, piece=p) for p in pieces]
    items += [_Item(v.nbytes, name=n, value=v) for n, v in objects]
    total = sum(item.nbytes for item in items)
    bins = _balance(items, max(1, min(threads, len(items), total // MIN_BYTES_PER_FILE)))
    result = RankWrites(files=[data_file_name(rank, i) for i in range(len(bins))],
                        used_pickle=any(v.used_pickle for _, v in objects))
    with ThreadPoolExecutor(max_workers=len(bins) or 1, thread_name_prefix="bcp-write") as pool:
        futures = [pool.submit(_write_file, location, generation, result.files[i], i, items, chunk)
                   for i, items in enumerate(bins)]
        for future in futures:
            written_pieces, written_objects = future.result()
            result.pieces += written_pieces
            result.objects += written_objects
    return result


def _balance(items: list[_Item], nbins: int) -> list[list[_Item]]:
    """Largest first into the emptiest file, so the writer threads finish together. One file
    keeps the given order."""
    if nbins == 1:
        return [items] if items else []
    bins: list[list[_Item]] = [[] for _ in range(nbins)]
    sizes = [0] * nbins
    for item in sorted(items, key=lambda it: -it.nbytes):
        i = sizes.index(min(sizes))
        bins[i].append(item)
        sizes[i] += item.nbytes
    return [b for b in bins if b]


def _write_file(location: Location, generation: int, name: str, file_index: int, items: list[_Item],
                chunk: int) -> tuple[list[list], list[list]]:
    pieces: list[list] = []
    objects: list[list] = []

    def stream() -> Iterator[memoryview]:
        offset = 0
        for item in items:
            if item.piece is not None:
                data = byte_view(host_contiguous(item.piece.tensor))
                pieces.append([item.piece.spec, file_index, offset, data.nbytes, chunk_crcs(data, chunk)])
            else:
                data = memoryview(b"".join(item.value.chunks()))  # small: one buffer, one checksum pass
                objects.append([item.name, file_index, offset, data.nbytes, len(item.value.tree),
                                chunk_crcs(data, chunk)])
            yield data
            offset += data.nbytes

    try:
        location.storage.write_file(location.name(generation, name), stream())
    except OSError as exc:
        raise StorageError(f"writing {name} failed: {exc}", path=location.display) from exc
    return pieces, objects
