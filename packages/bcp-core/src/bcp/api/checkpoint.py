"""The reader door: a committed checkpoint opened for reading. ``bcp.load``, the tools and the
integrations read through it: the manifest, the wanted pieces (only the saved shards that overlap a
request are read, every byte checked against its checksum) and the per-rank values.

Opened with a coordinator, the open is collective: one rank reads the manifest and every rank
receives it, so storage serves the metadata once however many ranks load.
"""

from __future__ import annotations

import difflib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from bcp.api.location import resolve
from bcp.api.options import DEFAULT_IO_THREADS
from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, broadcast_from_root
from bcp.engine.location import Location, generation_dir
from bcp.engine.reader import ShardReader
from bcp.engine.redistribute import read_and_share
from bcp.errors import CheckpointError, CheckpointNotCommittedError, CheckpointNotFoundError, CorruptCheckpointError
from bcp.layout.box import Box
from bcp.layout.coverage import first_cover_problem
from bcp.layout.dtypes import dtype_from_name
from bcp.layout.indexing import box_for_index
from bcp.layout.manifest import Manifest, ObjectEntry, TensorEntry
from bcp.layout.shard_table import ByteRange
from bcp.layout.values import Resolve
from bcp.layout.piece import Piece
from bcp.layout.read_op import ReadOp, ReadRole
from bcp.planning.load_plan import check_meta, plan_reads, staged
from bcp.storage import Storage


class Checkpoint:
    """One committed generation of a checkpoint, opened for reading (see :func:`open_checkpoint`)."""

    def __init__(self, location: Location, generation: int, manifest: Manifest, *, verify: bool = True,
                 io_threads: int = DEFAULT_IO_THREADS) -> None:
        self.location = location
        self.generation = generation
        self.manifest = manifest
        self.io_threads = io_threads
        self._reader = ShardReader(location, generation, manifest, verify=verify)
        self._covered: set[str] = set()

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

    @property
    def bytes_read(self) -> int:
        """Bytes read from storage through this checkpoint so far."""
        return self._reader.bytes_read

    @property
    def value_bytes_read(self) -> int:
        """Of :attr:`bytes_read`, those of values (the rest are tensors' bytes)."""
        return self._reader.value_bytes_read

    def run_reads(self, ops: list[ReadOp], on_done: Callable[[ReadOp], None] | None = None) -> None:
        """Run planned reads (:meth:`plan`), filling their destinations, on up to ``io_threads``
        threads; ``on_done(op)`` (on a reader thread) once each op's bytes are in place."""
        self._reader.run(ops, self.io_threads, on_done)

    def run_reads_shared(self, ops: list[ReadOp], roles: list[ReadRole], group: Any) -> int:
        """Run planned reads under ``roles`` (one per op: read it, or receive it from the rank that
        does) over the process ``group``; returns the bytes received from other ranks."""
        return read_and_share(self._reader, ops, roles, group, self.io_threads)

    def read_range(self, where: ByteRange, start: int, dest: memoryview, key: str) -> None:
        """Read ``dest.nbytes`` bytes from ``start`` of the stored range ``where`` (checked against
        its checksums when verifying)."""
        self._reader.read_range(where, start, dest, key)

    def read_stored(self, where: ByteRange, start: int, dest: memoryview, key: str) -> None:
        """Read ``dest.nbytes`` of the range ``where``'s bytes as stored, from ``start``: whole
        compressed chunks, checked against the checksums of their stored bytes (when verifying)
        without decoding them; of a range stored raw, as :meth:`read_range`."""
        self._reader.read_stored(where, start, dest, key)

    def generations(self) -> list[tuple[int, bool]]:
        """Every generation under the path with its commit state, oldest first."""
        return [(g, self.location.is_committed(g)) for g in self.location.generations()]

    def plan(self, pieces: list[Piece]) -> list[ReadOp]:
        """The reads that fill ``pieces`` (boxes of saved tensors, in global coordinates), after
        checking that the saved shards of their tensors cover each exactly."""
        self.check_covered({piece.name for piece in pieces})
        return plan_reads(self.manifest, pieces)

    def read_pieces(self, pieces: list[Piece]) -> None:
        """Fill ``pieces`` in place from the saved shards; a piece whose dtype is not its tensor's
        saved one (which ``check_meta`` allows with ``cast_dtype``) is read in the saved dtype and
        converted."""
        reads, pairs = staged(self.manifest, pieces, every=False)
        self._reader.run(self.plan(reads), self.io_threads)
        for piece, staging in pairs:
            piece.tensor.copy_(staging)

    def read(self, name: str, index: Any = None) -> torch.Tensor:
        """Tensor ``name``, or ``tensor[index]`` for an index of integers, slices and ``...``; only
        the box the index spans is read."""
        entry = self.tensor_entry(name)
        if index is None:
            return self.read_box(name, Box.whole(entry.shape))
        box, within = box_for_index(index, entry.shape)
        # A stepped slice is a strided view of the box: contiguous() copies it out so the box is freed.
        return self.read_box(name, box)[within].contiguous()

    def empty_tensor(self, name: str) -> torch.Tensor:
        """An uninitialised CPU tensor of tensor ``name``'s saved dtype and shape."""
        entry = self.tensor_entry(name)
        return torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))

    def read_box(self, name: str, box: Box) -> torch.Tensor:
        """The region ``box`` (global coordinates) of tensor ``name`` as a new CPU tensor."""
        entry = self.tensor_entry(name)
        if not box.within(entry.shape):
            raise IndexError(f"{box} lies outside the shape {list(entry.shape)} of {name!r}")
        dtype = dtype_from_name(entry.dtype)
        piece = Piece(name, dtype, entry.shape, box, torch.empty(box.lengths, dtype=dtype))
        self.read_pieces([piece])
        return piece.tensor

    def read_object(self, name: str, *, rank: int = 0, allow_pickle: bool = False,
                    resolve: Resolve | None = None) -> Any:
        """The value ``name`` as saved by ``rank`` (values are saved per rank). The tensors it held
        are read from where they are saved beside it (``resolve(name)`` gives them instead)."""
        entry = self.objects.get(name)
        if entry is None:
            raise CheckpointError(f"no value named {name!r}{_suggest(name, self.objects)}", path=self.path)
        if not 0 <= rank < len(entry.ranks) or entry.ranks[rank] < 0:
            saved = [r for r, record in enumerate(entry.ranks) if record >= 0]
            raise CheckpointError(f"rank {rank} saved no value {name!r}; ranks that did: {saved}", path=self.path)
        return self._reader.read_object(entry, rank, allow_pickle=allow_pickle,
                                        resolve=resolve or self.held_tensors(rank, allow_pickle=allow_pickle))

    def read_objects(self, sources: dict[str, int], *, allow_pickle: bool = False,
                     resolve: Resolve | None = None) -> dict[str, Any]:
        """Each value ``name`` as saved by rank ``sources[name]``, read concurrently on up to
        ``io_threads`` threads: a rank's dataloader parts (token buffers of many MB each) arrive
        side by side, not one after another (the paper's dataloader stragglers, section 6.4)."""
        if len(sources) <= 1 or self.io_threads <= 1:
            return {name: self.read_object(name, rank=rank, allow_pickle=allow_pickle, resolve=resolve)
                    for name, rank in sources.items()}
        with ThreadPoolExecutor(min(self.io_threads, len(sources)), thread_name_prefix="bcp-values") as pool:
            futures = {name: pool.submit(self.read_object, name, rank=rank, allow_pickle=allow_pickle, resolve=resolve)
                       for name, rank in sources.items()}
            return {name: future.result() for name, future in futures.items()}

    def held_tensors(self, rank: int, *, allow_pickle: bool = False, known: Mapping[str, Any] | None = None) -> Resolve:
        """The tensors a value saved by ``rank`` refers to: ``known[name]`` where given, else read
        (a tensor entry, or that rank's per-rank tensor)."""
        def resolve(name: str) -> Any:
            if known is not None and name in known:
                return known[name]
            if name in self.tensors:
                return self.read(name)
            if name in self.objects:
                return self.read_object(name, rank=self.value_source(name, rank), allow_pickle=allow_pickle)
            raise CorruptCheckpointError(f"a value refers to the tensor {name!r}, which the checkpoint does not hold",
                                         path=self.path, key=name)
        return resolve

    def distinct_values(self, name: str, *, allow_pickle: bool = False) -> list[Any]:
        """Every different value saved under ``name``, in the order of the first rank that saved
        each (replicas' records, identical to the byte, are read once)."""
        entry = self.objects[name]
        seen: dict[tuple, int] = {}
        for rank, record in enumerate(entry.ranks):
            where = entry.records[record][0] if record >= 0 else None
            if where is not None:
                seen.setdefault((where.nbytes, where.crcs), rank)
        return [self._reader.read_object(entry, rank, allow_pickle=allow_pickle) for rank in seen.values()]

    def value_source(self, name: str, rank: int | None = None) -> int:
        """Whose saved value ``name`` rank ``rank`` receives: its own, else the first rank's that
        saved one (without a rank: the first rank's)."""
        ranks = self.objects[name].ranks
        if rank is not None and 0 <= rank < len(ranks) and ranks[rank] >= 0:
            return rank
        return next(r for r, record in enumerate(ranks) if record >= 0)

    def check_meta(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], *, cast_dtype: bool = False) -> None:
        """The live tensor ``name`` must have the saved global shape, and the saved dtype unless
        ``cast_dtype``."""
        check_meta(self.manifest, name, dtype, shape, self.path, cast_dtype=cast_dtype)

    def tensor_entry(self, name: str) -> TensorEntry:
        entry = self.tensors.get(name)
        if entry is None:
            in_objects = name in self.objects
            hint = " (it is a non-tensor value: use read_object)" if in_objects else _suggest(name, self.tensors)
            raise CheckpointError(f"no tensor named {name!r}{hint}", path=self.path)
        return entry

    def check_covered(self, names: Iterable[str]) -> None:
        """The saved shards of each named tensor hold each of its elements exactly once."""
        names = [n for n in names if n not in self._covered and n in self.tensors]
        if not names:
            return
        by_table: dict[int, tuple[Any, list[str], list[np.ndarray], list[np.ndarray]]] = {}
        for name in names:
            table, first, count = self.tensors[name].table_rows(self.manifest.checksum_chunk)
            _, group, rows, owners = by_table.setdefault(id(table), (table, [], [], []))
            rows.append(np.arange(first, first + count, dtype=np.int64))
            owners.append(np.full(count, len(group), dtype=np.int64))
            group.append(name)
        for table, group, rows, owners in by_table.values():
            picked = np.concatenate(rows)
            problem = first_cover_problem([self.tensors[n].shape for n in group], np.concatenate(owners),
                                          table.offsets[picked], table.lengths[picked])
            if problem is not None:
                raise CorruptCheckpointError(
                    f"the saved shards do not cover the tensor exactly: {problem.describe()}",
                    path=f"{self.path}/{generation_dir(self.generation)}", key=group[problem.tensor])
        self._covered.update(names)


def open_checkpoint(path: "str | os.PathLike | Storage", *, role: str | None = None, generation: int | None = None,
                    verify: bool = True, io_threads: int = DEFAULT_IO_THREADS,
                    coordinator: Coordinator | None = None) -> Checkpoint:
    """Open the newest committed generation at ``path`` (or ``generation``) for reading.

    Only the manifest is read here. ``verify`` checks every byte read later against its checksum.
    With a ``coordinator`` every rank calls it: rank 0 reads the manifest and sends it to the others.
    """
    location = resolve(path, role)
    if coordinator is None or coordinator.world_size == 1:
        chosen, data, table = _manifest_files(location, generation)
    else:
        found = Outcome.of(lambda: _manifest_files(location, generation)) if coordinator.rank == 0 else Outcome()
        chosen, data, table = broadcast_from_root(coordinator, found, f"opening {location.display}")
    manifest = Manifest.decode(data, table, path=f"{location.display}/{generation_dir(chosen)}")
    return Checkpoint(location, chosen, manifest, verify=verify, io_threads=io_threads)


def read_tensor(path: "str | os.PathLike | Storage", name: str, index: Any = None, *, role: str | None = None,
                verify: bool = True) -> torch.Tensor:
    """Tensor ``name`` (or ``tensor[index]``) from the newest committed checkpoint at ``path``."""
    return open_checkpoint(path, role=role, verify=verify).read(name, index)


def _manifest_files(location: Location, generation: int | None) -> list[Any]:
    """``[generation, manifest bytes, shard table bytes]`` of ``generation``, or of the newest
    committed one (retried on a newer one if a concurrent save's retention removes it meanwhile)."""
    try:
        if generation is None:
            return [*location.read_latest_manifest_files()]
        chosen = _committed(location, generation)
        return [chosen, *location.read_manifest_files(chosen)]
    except CheckpointNotFoundError:
        hint = _other_format_hint(location)
        if hint:
            raise CheckpointNotFoundError(f"not a bcp checkpoint: {hint}", path=location.display) from None
        raise


def _committed(location: Location, generation: int) -> int:
    if generation not in location.generations():
        kept = [g for g in location.generations() if location.is_committed(g)]
        raise CheckpointNotFoundError(f"there is no generation {generation} ({generation_dir(generation)}); the "
                                      f"committed generations kept are {kept}", path=location.display)
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
