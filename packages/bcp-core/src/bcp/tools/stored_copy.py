"""``bcp copy``: one generation as a checkpoint of its own, its stored bytes copied as they are.

Every stored range the generation uses (tensor shards and value records, those an incremental save
left in earlier generations' files included) is read, checked against its checksums and written
into a data file of the copy, in the order it lay in its source file; the copy's manifest is the
source's with the new places. A compressed chunk is checked against the checksum of its stored
bytes and copied as stored: nothing is decompressed or compressed again. Memory holds one block of
a range at a time.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Iterator, Sequence

from bcp.engine.location import Location
from bcp.layout.manifest import ByteRange, Manifest, ObjectEntry, TensorEntry
from bcp.layout.references import copied_name
from bcp.layout.shard_table import ShardEntry
from bcp.tools.build import new_generation, showing
from bcp.tools.checkpoint import Checkpoint
from bcp.tools.progress import NoProgress, Progress
from bcp.version import __version__

#: Checksum chunks read per request: whole chunks, so that each is checked as it arrives.
BLOCK_CHUNKS = 4

#: Where a stored range lies: file index, offset and stored length.
Place = tuple[int, int, int]
#: A stored range, its stored length, and an entry it belongs to (named in errors).
Range = tuple[ByteRange, int, str]


def copy_stored(checkpoint: Checkpoint, out: "str | os.PathLike | Location", *, sources: Sequence[str],
                progress: Progress | None = None) -> int:
    """Copy ``checkpoint``'s stored ranges into a new generation at ``out`` (a new or empty folder
    apart from ``sources``) and commit it; returns the generation."""
    manifest = checkpoint.manifest
    ranges = _ranges(manifest)
    files, per_file, places = _layout(manifest, ranges)
    with new_generation(out, sources) as (location, generation), \
            showing(progress or NoProgress(), "copy", sum(span for _, span, _ in ranges.values())) as advance:
        for name, stored in zip(files, per_file):
            location.storage.write_file(location.name(generation, name), _blocks(checkpoint, stored, advance))
        location.commit(generation, _placed(manifest, generation, files, places))
    return generation


def _ranges(manifest: Manifest) -> dict[Place, Range]:
    """Every distinct stored range (tensors sharing bytes share one), in the order of its file and offset."""
    found: dict[Place, Range] = {}
    for name, entry in manifest.tensors.items():
        for shard in entry.shards:
            found.setdefault(_place(shard.bytes), (shard.bytes, shard.bytes.stored_nbytes, name))
    for name, value in manifest.objects.items():
        for where, _ in value.records:
            found.setdefault(_place(where), (where, where.stored_nbytes, name))
    return dict(sorted(found.items()))


def _layout(manifest: Manifest, ranges: dict[Place, Range]) -> tuple[list[str], list[list[Range]], dict[Place, Place]]:
    """The copy's data files (each source file that holds a range, under its name in a generation of
    its own), the ranges each receives, and each range's place in them: a file's ranges one after
    another."""
    files: list[str] = []
    per_file: list[list[Range]] = []
    index: dict[int, int] = {}
    ends: list[int] = []
    places: dict[Place, Place] = {}
    for place, stored in ranges.items():
        file = place[0]
        if file not in index:
            index[file] = len(files)
            files.append(copied_name(manifest.files[file]))
            per_file.append([])
            ends.append(0)
        places[place] = (index[file], ends[index[file]], stored[1])
        per_file[index[file]].append(stored)
        ends[index[file]] += stored[1]
    return files, per_file, places


def _blocks(checkpoint: Checkpoint, ranges: list[Range], advance: Callable[[int], None]) -> Iterator[memoryview]:
    """The stored bytes of ``ranges``, block by block, each block checked before it is handed on."""
    for where, _, key in ranges:
        for start, end in _blocks_of(where, checkpoint.manifest.checksum_chunk):
            data = memoryview(bytearray(end - start))
            checkpoint.read_stored(where, start, data, key)
            advance(data.nbytes)
            yield data


def _blocks_of(where: ByteRange, chunk: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the blocks of ``BLOCK_CHUNKS`` whole chunks that ``where``'s stored bytes
    are read in (a compressed chunk can only be checked whole)."""
    starts = where.stored.starts() if where.stored is not None else [*range(0, where.nbytes, chunk), where.nbytes]
    bounds = starts[::BLOCK_CHUNKS]
    if bounds[-1] != starts[-1]:
        bounds.append(starts[-1])
    return list(zip(bounds, bounds[1:]))


def _placed(manifest: Manifest, generation: int, files: list[str], places: dict[Place, Place]) -> Manifest:
    """``manifest`` as the copy's: its ranges at their new places, listing only the copy's files."""
    def moved(where: ByteRange) -> ByteRange:
        file, offset, _ = places[_place(where)]
        return dataclasses.replace(where, file=file, offset=offset)

    tensors = {name: TensorEntry(name, entry.dtype, entry.shape,
                                 [ShardEntry(shard.box, moved(shard.bytes)) for shard in entry.shards])
               for name, entry in manifest.tensors.items()}
    objects = {name: ObjectEntry(name, [(moved(where), tree) for where, tree in value.records], list(value.ranks))
               for name, value in manifest.objects.items()}
    return dataclasses.replace(manifest.copied_as(generation), files=files, tensors=tensors, objects=objects,
                               created_unix=time.time(), writer=f"bcp {__version__} (copied)")


def _place(where: ByteRange) -> Place:
    return where.file, where.offset, where.stored_nbytes
