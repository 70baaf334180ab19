"""Writing a new committed checkpoint piece by piece, for the tools that make one checkpoint from
another (convert, edit). It goes through the same planner and writer door as ``bcp.save``; each
piece's data is produced when it is written and released right after, so memory holds about one
piece per writer thread however large the checkpoint is."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch

from bcp.api.location import resolve
from bcp.api.results import PhaseStats
from bcp.api.writing import write_generation
from bcp.chunk_codecs import Compression
from bcp.coord import SingleProcessCoordinator
from bcp.engine.location import Location, generation_dir
from bcp.engine.writer import GenerationWriter
from bcp.errors import CheckpointError
from bcp.layout.box import Box
from bcp.layout.dtypes import dtype_name, itemsize
from bcp.layout.local_plan import LocalPlan
from bcp.layout.manifest import DEFAULT_CHECKSUM_CHUNK, Manifest, TensorEntry
from bcp.layout.values import encode_value
from bcp.layout.write_plan import PieceWrite, ValueWrite
from bcp.layout.write_report import RankWrites
from bcp.planning.assembly import assemble_manifest
from bcp.planning.save_plan import PlanColumns, global_plan
from bcp.tools.paths import check_new_output
from bcp.tools.progress import NoProgress, Progress
from bcp.version import __version__


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
    #: The records may refer to tensors saved beside them (copied from a checkpoint that has such records).
    refs: bool = False

    @staticmethod
    def of(name: str, value: object, world_size: int = 1) -> "ValueSource":
        """``value`` in bcp's safe encoding, as saved alike by every rank."""
        encoded = encode_value(value, key=name)
        return ValueSource(name, [(b"".join(encoded.chunks()), len(encoded.tree))], [0] * world_size)

    def writes(self) -> list[ValueWrite]:
        """One record write per record, standing for the ranks that saved it."""
        return [ValueWrite(self.name, (data,), tree_nbytes,
                           ranks=tuple(r for r, index in enumerate(self.ranks) if index == i), refs=self.refs)
                for i, (data, tree_nbytes) in enumerate(self.records)]


def write_checkpoint(out: "str | os.PathLike | Location", pieces: Sequence[PieceSource],
                     values: Sequence[ValueSource], *, note: str, framework: str = "plain", world_size: int = 1,
                     aliases: Mapping[str, str] | None = None, unsafe_pickle: bool = False,
                     sources: Sequence["str | os.PathLike"] = (), compression: "Compression | str | bool | None" = None,
                     progress: Progress | None = None, io_threads: int = 1) -> int:
    """Write a committed checkpoint at ``out`` (a new or empty folder, apart from every ``sources``
    path; or the location of an existing checkpoint, whose newest generation it becomes, with that
    location's retention after the commit) and return its generation. ``aliases`` (name -> name of a
    piece's tensor) add entries that share another tensor's stored bytes, as tied weights do.
    ``compression``: the codec the data is stored with (None: uncompressed), as ``bcp.save`` takes it. A
    failure removes what was written (never a committed generation). Memory holds about one piece
    per writer thread (``io_threads``, by default one)."""
    columns = PlanColumns([_local_plan(pieces)])
    global_plan(columns)  # checks that the pieces agree on dtype and shape and cover every tensor exactly
    writes = [PieceWrite(i, None, _checked(piece), piece.nbytes, dtype=piece.dtype) for i, piece in enumerate(pieces)]
    compression = Compression.of(compression)

    def manifest_of(reports: list[RankWrites]) -> Manifest:
        manifest = assemble_manifest(generation=generation, framework=framework,
                                     checksum_chunk=DEFAULT_CHECKSUM_CHUNK, writer=f"bcp {__version__} ({note})",
                                     columns=columns, reports=reports, world_size=world_size,
                                     compression=compression)
        manifest.unsafe_pickle = unsafe_pickle
        _add_aliases(manifest.tensors, aliases or {})
        return manifest

    with new_generation(out, sources) as (location, generation), \
            showing(progress or NoProgress(), note, sum(p.nbytes for p in pieces)) as advance:
        write_generation(SingleProcessCoordinator(),
                         GenerationWriter(location, generation, threads=io_threads, compression=compression),
                         writes, [w for v in values for w in v.writes()], manifest_of, PhaseStats(), advance)
    return generation


@contextmanager
def new_generation(out: "str | os.PathLike | Location",
                   sources: Sequence["str | os.PathLike"]) -> Iterator[tuple[Location, int]]:
    """The claimed next generation of ``out`` (a new or empty folder apart from every ``sources``
    path, or an existing checkpoint's location), for the body to write and commit. A failure
    removes what was written into a new output (in an existing checkpoint, the writer door has
    discarded an uncommitted generation)."""
    new_output = not isinstance(out, Location)
    location = resolve(check_new_output(out, sources), None) if new_output else out
    generation = location.claim_next_generation()
    try:
        yield location, generation
    except BaseException:
        if new_output:  # the output was new or empty, so the claim is ours alone: leave nothing behind
            location.storage.delete_tree(f"{location.prefix}{generation_dir(generation)}")
        raise


@contextmanager
def showing(progress: Progress, label: str, total: int) -> Iterator[Callable[[int], None]]:
    """``progress`` started for ``total`` bytes, its ``advance`` for the body, finished however the body ends."""
    progress.start(label, total)
    try:
        yield progress.advance
    finally:
        progress.finish()


def _checked(piece: PieceSource) -> Callable[[], torch.Tensor]:
    """``piece.produce``, refusing a tensor of another dtype or shape than the piece's."""
    def produce() -> torch.Tensor:
        tensor = piece.produce()
        if tensor.dtype != piece.dtype or tuple(tensor.shape) != piece.box.lengths:
            raise CheckpointError(f"produced {tensor.dtype} {list(tensor.shape)} for a piece of "
                                  f"{piece.dtype} {list(piece.box.lengths)}", key=piece.name)
        return tensor
    return produce


def _local_plan(pieces: Sequence[PieceSource]) -> LocalPlan:
    """The pieces as the planner's columns (one writer, every tensor declared once)."""
    declared: dict[str, tuple[str, torch.dtype, tuple[int, ...]]] = {}
    for piece in pieces:
        name, dtype, shape = declared.setdefault(piece.name, (piece.name, piece.dtype, tuple(piece.shape)))
        if (dtype, shape) != (piece.dtype, tuple(piece.shape)):
            raise CheckpointError(f"pieces disagree on dtype/shape: {dtype_name(dtype)} {list(shape)} and "
                                  f"{dtype_name(piece.dtype)} {list(piece.shape)}", key=name)
    return LocalPlan.of(list(declared.values()), pieces)


def _add_aliases(tensors: dict[str, TensorEntry], aliases: Mapping[str, str]) -> None:
    for alias, target in aliases.items():
        if alias in tensors:
            raise CheckpointError(f"cannot alias {alias!r} to {target!r}: {alias!r} is already a tensor", key=alias)
        entry = tensors.get(target)
        if entry is None:
            raise CheckpointError(f"cannot alias {alias!r} to {target!r}: no such tensor is written", key=alias)
        tensors[alias] = TensorEntry(alias, entry.dtype, entry.shape, list(entry.shards))
