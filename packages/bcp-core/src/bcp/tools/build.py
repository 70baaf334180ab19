"""Writing a new committed checkpoint piece by piece, for the tools that make one checkpoint from
another (convert, edit). Each piece's data is produced when it is written and released right after,
so memory holds about one piece at a time however large the checkpoint is."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch

from bcp.api.location import resolve
from bcp.engine.bytes_of import byte_view, host_contiguous
from bcp.engine.checksum import chunk_crcs
from bcp.engine.location import Location, data_file_name, generation_dir
from bcp.errors import CheckpointError
from bcp.layout.box import Box
from bcp.layout.dtypes import dtype_name, itemsize
from bcp.layout.manifest import DEFAULT_CHECKSUM_CHUNK, ByteRange, Manifest, ObjectEntry, ShardEntry, TensorEntry
from bcp.layout.values import encode_value
from bcp.tools.paths import check_new_output
from bcp.tools.progress import NoProgress, Progress
from bcp.version import __version__

# A new data file is started once a file holds this much; fewer, larger files suit object stores.
MAX_FILE_BYTES = 1 << 30


@dataclass(frozen=True)
class PieceSource:
    """Region ``box`` of tensor ``name``; ``produce()`` returns its data (called once, when written)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    box: Box
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class ValueSource:
    """A non-tensor entry: encoded records (bytes, length of the value tree) and, per saved rank,
    the index of its record (-1: that rank saved none)."""

    name: str
    records: list[tuple[bytes, int]]
    ranks: list[int]

    @staticmethod
    def of(name: str, value: object, world_size: int = 1) -> "ValueSource":
        """``value`` in bcp's safe encoding, as saved alike by every rank."""
        encoded = encode_value(value, key=name)
        return ValueSource(name, [(b"".join(encoded.chunks()), len(encoded.tree))], [0] * world_size)


def write_checkpoint(out: "str | os.PathLike", pieces: Sequence[PieceSource], values: Sequence[ValueSource], *,
                     note: str, framework: str = "plain", world_size: int = 1, aliases: Mapping[str, str] | None = None,
                     unsafe_pickle: bool = False, sources: Sequence["str | os.PathLike"] = (),
                     progress: Progress | None = None) -> int:
    """Write a committed checkpoint at ``out`` (a new or empty folder, apart from every ``sources``
    path) and return its generation. ``aliases`` (name -> name of a piece's tensor) add entries that
    share another tensor's stored bytes, as tied weights do. A failure removes what was written."""
    location = resolve(check_new_output(out, sources), None)
    generation = location.next_generation()
    progress = progress or NoProgress()
    progress.start(note, sum(p.nbytes for p in pieces))
    try:
        files, tensors = _write_pieces(location, generation, pieces, progress)
        objects = _write_values(location, generation, values, files)
        _add_aliases(tensors, aliases or {})
        _check_covered(tensors)
        manifest = Manifest(generation=generation, world_size=world_size, framework=framework, files=files,
                            tensors=tensors, objects=objects, checksum_chunk=DEFAULT_CHECKSUM_CHUNK,
                            unsafe_pickle=unsafe_pickle, created_unix=time.time(),
                            writer=f"bcp {__version__} ({note})")
        location.commit(generation, manifest)
    except BaseException:
        location.storage.delete_tree(f"{location.prefix}{generation_dir(generation)}")
        raise
    finally:
        progress.finish()
    return generation


def _write_pieces(location: Location, generation: int, pieces: Sequence[PieceSource],
                  progress: Progress) -> tuple[list[str], dict[str, TensorEntry]]:
    tensors: dict[str, TensorEntry] = {}
    for piece in pieces:
        entry = tensors.setdefault(piece.name, TensorEntry(piece.name, dtype_name(piece.dtype), piece.shape))
        if (entry.dtype, entry.shape) != (dtype_name(piece.dtype), piece.shape):
            raise CheckpointError(f"pieces disagree on dtype/shape: {entry.dtype} {list(entry.shape)} and "
                                  f"{dtype_name(piece.dtype)} {list(piece.shape)}", key=piece.name)
    files: list[str] = []
    for group in _file_groups(pieces):
        name = data_file_name(0, len(files))
        stream = _stream(group, len(files), tensors, progress)
        location.storage.write_file(location.name(generation, name), stream)
        files.append(name)
    return files, tensors


def _file_groups(pieces: Sequence[PieceSource]) -> Iterator[list[PieceSource]]:
    group: list[PieceSource] = []
    size = 0
    for piece in pieces:
        if group and size + piece.nbytes > MAX_FILE_BYTES:
            yield group
            group, size = [], 0
        group.append(piece)
        size += piece.nbytes
    if group:
        yield group


def _stream(pieces: list[PieceSource], file: int, tensors: dict[str, TensorEntry],
            progress: Progress) -> Iterator[memoryview]:
    offset = 0
    for piece in pieces:
        tensor = host_contiguous(piece.produce())
        if tensor.dtype != piece.dtype or tuple(tensor.shape) != piece.box.lengths:
            raise CheckpointError(f"produced {tensor.dtype} {list(tensor.shape)} for a piece of "
                                  f"{piece.dtype} {list(piece.box.lengths)}", key=piece.name)
        data = byte_view(tensor)
        where = ByteRange(file, offset, data.nbytes, tuple(chunk_crcs(data, DEFAULT_CHECKSUM_CHUNK)))
        tensors[piece.name].shards.append(ShardEntry(piece.box, where))
        yield data
        offset += data.nbytes
        progress.advance(data.nbytes)
        del tensor, data  # release this piece before the next one is produced


def _write_values(location: Location, generation: int, values: Sequence[ValueSource],
                  files: list[str]) -> dict[str, ObjectEntry]:
    if not values:
        return {}
    file = len(files)
    objects: dict[str, ObjectEntry] = {}
    chunks: list[memoryview] = []
    offset = 0
    for value in values:
        records = []
        for data, tree_nbytes in value.records:
            view = memoryview(data)
            records.append((ByteRange(file, offset, view.nbytes, tuple(chunk_crcs(view, DEFAULT_CHECKSUM_CHUNK))),
                            tree_nbytes))
            chunks.append(view)
            offset += view.nbytes
        objects[value.name] = ObjectEntry(value.name, records, list(value.ranks))
    files.append(data_file_name(0, file))
    location.storage.write_file(location.name(generation, files[-1]), chunks)
    return objects


def _add_aliases(tensors: dict[str, TensorEntry], aliases: Mapping[str, str]) -> None:
    for alias, target in aliases.items():
        if alias in tensors:
            raise CheckpointError(f"cannot alias {alias!r} to {target!r}: {alias!r} is already a tensor", key=alias)
        entry = tensors.get(target)
        if entry is None:
            raise CheckpointError(f"cannot alias {alias!r} to {target!r}: no such tensor is written", key=alias)
        tensors[alias] = TensorEntry(alias, entry.dtype, entry.shape, list(entry.shards))


def _check_covered(tensors: dict[str, TensorEntry]) -> None:
    for name, entry in tensors.items():
        covered = sum(s.box.numel for s in entry.shards)
        if covered != math.prod(entry.shape):
            raise CheckpointError(f"the written pieces hold {covered} of {math.prod(entry.shape)} elements", key=name)
