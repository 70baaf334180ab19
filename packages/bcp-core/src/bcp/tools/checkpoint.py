"""Reading a committed checkpoint piece by piece: one tensor, a slice of one, or one value, without
loading the rest. Reads go through the engine's planner and reader, so only the saved shards that
overlap the request are read, and every byte read is checked against its checksum."""

from __future__ import annotations

import difflib
import os
from typing import Any

import torch

from bcp.api.location import resolve
from bcp.api.save import DEFAULT_IO_THREADS
from bcp.engine.location import Location, generation_dir
from bcp.engine.reader import ShardReader
from bcp.errors import CheckpointError, CheckpointNotCommittedError, CheckpointNotFoundError
from bcp.layout.box import Box
from bcp.layout.dtypes import dtype_from_name
from bcp.layout.manifest import Manifest, ObjectEntry, TensorEntry
from bcp.planning.load_plan import plan_reads
from bcp.planning.pieces import Piece
from bcp.storage import Storage
from bcp.tools.indexing import box_for_index


class Checkpoint:
    """One committed generation of a checkpoint, opened for reading (see :func:`open_checkpoint`)."""

    def __init__(self, location: Location, generation: int, manifest: Manifest, *, verify: bool = True,
                 io_threads: int = DEFAULT_IO_THREADS) -> None:
        self.location = location
        self.generation = generation
        self.manifest = manifest
        self.io_threads = io_threads
        self.reader = ShardReader(location, generation, manifest, verify=verify)

    @property
    def path(self) -> str:
        return self.location.display

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        """Tensor entries by full name (``model/<fqn>``, ``optimizer/state/<fqn>/<key>``, ...)."""
        return self.manifest.tensors

    @property
    def objects(self) -> dict[str, ObjectEntry]:
        """Non-tensor entries (per-rank values) by full name."""
        return self.manifest.objects

    def generations(self) -> list[tuple[int, bool]]:
        """Every generation under the path with its commit state, oldest first."""
        return [(g, self.location.is_committed(g)) for g in self.location.generations()]

    def read(self, name: str, index: Any = None) -> torch.Tensor:
        """Tensor ``name``, or ``tensor[index]`` for an index of integers, slices and ``...``; only
        the box the index spans is read."""
        entry = self.tensor_entry(name)
        if index is None:
            return self.read_box(name, Box.whole(entry.shape))
        box, within = box_for_index(index, entry.shape)
        # A stepped slice is a strided view of the box: contiguous() copies it out so the box is freed.
        return self.read_box(name, box)[within].contiguous()

    def read_box(self, name: str, box: Box) -> torch.Tensor:
        """The region ``box`` (global coordinates) of tensor ``name`` as a new CPU tensor."""
        entry = self.tensor_entry(name)
        if not box.within(entry.shape):
            raise IndexError(f"{box} lies outside the shape {list(entry.shape)} of {name!r}")
        dtype = dtype_from_name(entry.dtype)
        piece = Piece(name, dtype, entry.shape, box, torch.empty(box.lengths, dtype=dtype))
        self.reader.run(plan_reads(self.manifest, [piece], self.path), self.io_threads)
        return piece.tensor

    def read_object(self, name: str, *, rank: int = 0, allow_pickle: bool = False) -> Any:
        """The value ``name`` as saved by ``rank`` (values are saved per rank)."""
        entry = self.objects.get(name)
        if entry is None:
            raise CheckpointError(f"no value named {name!r}{_suggest(name, self.objects)}", path=self.path)
        if not 0 <= rank < len(entry.ranks) or entry.ranks[rank] < 0:
            saved = [r for r, record in enumerate(entry.ranks) if record >= 0]
            raise CheckpointError(f"rank {rank} saved no value {name!r}; ranks that did: {saved}", path=self.path)
        return self.reader.read_object(entry, rank, allow_pickle=allow_pickle)

    def tensor_entry(self, name: str) -> TensorEntry:
        entry = self.tensors.get(name)
        if entry is None:
            in_objects = name in self.objects
            hint = " (it is a non-tensor value: use read_object)" if in_objects else _suggest(name, self.tensors)
            raise CheckpointError(f"no tensor named {name!r}{hint}", path=self.path)
        return entry


def open_checkpoint(path: "str | os.PathLike | Storage", *, role: str | None = None, generation: int | None = None,
                    verify: bool = True, io_threads: int = DEFAULT_IO_THREADS) -> Checkpoint:
    """Open the newest committed generation at ``path`` (or ``generation``) for reading.

    Only the manifest is read here. ``verify`` checks every byte read later against its checksum.
    """
    location = resolve(path, role)
    try:
        chosen = location.latest_committed() if generation is None else _committed(location, generation)
    except CheckpointNotFoundError:
        hint = _other_format_hint(location)
        if hint:
            raise CheckpointNotFoundError(f"not a bcp checkpoint: {hint}", path=location.display) from None
        raise
    manifest = location.read_manifest(chosen)
    return Checkpoint(location, chosen, manifest, verify=verify, io_threads=io_threads)


def read_tensor(path: "str | os.PathLike | Storage", name: str, index: Any = None, *, role: str | None = None,
                verify: bool = True) -> torch.Tensor:
    """Tensor ``name`` (or ``tensor[index]``) from the newest committed checkpoint at ``path``."""
    return open_checkpoint(path, role=role, verify=verify).read(name, index)


def _committed(location: Location, generation: int) -> int:
    if generation not in location.generations():
        raise CheckpointNotFoundError(f"there is no {generation_dir(generation)} (generations: "
                                      f"{location.generations()})", path=location.display)
    if not location.is_committed(generation):
        raise CheckpointNotCommittedError(f"{generation_dir(generation)} was never committed", path=location.display)
    return generation


def _other_format_hint(location: Location) -> str:
    storage, prefix = location.storage, location.prefix
    if storage.exists(prefix + ".metadata"):
        return "it looks like a PyTorch DCP checkpoint: convert it with `bcp convert --from dcp`"
    if any(name.endswith(".safetensors") for name in storage.list_dir(prefix.rstrip("/"))):
        return "it looks like a safetensors folder: convert it with `bcp convert --from hf`"
    return ""


def _suggest(name: str, names: Any) -> str:
    close = difflib.get_close_matches(name, list(names), n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""
