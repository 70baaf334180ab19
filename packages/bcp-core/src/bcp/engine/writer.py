"""Writing one rank's share of a checkpoint: pieces and object records into data files, with
chunk checksums, several files in parallel (one writer thread per file)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

from bcp.engine.bytes_of import byte_view, host_contiguous
from bcp.engine.checksum import chunk_crcs
from bcp.engine.location import Location, data_file_name
from bcp.errors import StorageError
from bcp.layout.values import EncodedValue
from bcp.planning.pieces import Piece


# Below this many bytes per file, another file (and writer thread) costs more than it saves.
MIN_BYTES_PER_FILE = 32 << 20


@dataclass(slots=True)
class _Item:
    key: int | str  # piece index, or object name
    nbytes: int
    piece: Piece | None = None
    value: EncodedValue | None = None


@dataclass
class RankWrites:
    """What a rank wrote, as plain data for the coordinator: file names, and per piece/object
    ``[key, file index, offset, nbytes, crcs]`` (objects also carry their tree length)."""

    files: list[str] = field(default_factory=list)
    pieces: list[list] = field(default_factory=list)
    objects: list[list] = field(default_factory=list)

    def to_wire(self) -> list:
        return [self.files, self.pieces, self.objects]


def write_rank(location: Location, generation: int, rank: int, pieces: list[tuple[int, Piece]],
               objects: list[tuple[str, EncodedValue]], threads: int, chunk: int) -> RankWrites:
    items = [_Item(i, p.nbytes, piece=p) for i, p in pieces] + [_Item(n, v.nbytes, value=v) for n, v in objects]
    total = sum(item.nbytes for item in items)
    bins = _balance(items, max(1, min(threads, len(items), total // MIN_BYTES_PER_FILE)))
    result = RankWrites(files=[data_file_name(rank, i) for i in range(len(bins))])
    with ThreadPoolExecutor(max_workers=len(bins) or 1, thread_name_prefix="bcp-write") as pool:
        futures = [pool.submit(_write_file, location, generation, result.files[i], i, items, chunk)
                   for i, items in enumerate(bins)]
        for future in futures:
            written_pieces, written_objects = future.result()
            result.pieces += written_pieces
            result.objects += written_objects
    return result


def _balance(items: list[_Item], nbins: int) -> list[list[_Item]]:
    """Largest first into the emptiest file, so the writer threads finish together."""
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
                pieces.append([item.key, file_index, offset, data.nbytes, chunk_crcs(data, chunk)])
                yield data
                offset += data.nbytes
            else:
                record = memoryview(b"".join(item.value.chunks()))  # small: one buffer, one checksum pass
                objects.append([item.key, file_index, offset, record.nbytes, len(item.value.tree),
                                chunk_crcs(record, chunk)])
                yield record
                offset += record.nbytes

    try:
        location.storage.write_file(location.name(generation, name), stream())
    except OSError as exc:
        raise StorageError(f"writing {name} failed: {exc}", path=location.display) from exc
    return pieces, objects
