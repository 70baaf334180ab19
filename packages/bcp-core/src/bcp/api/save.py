"""``bcp.save``: every rank calls it. A synchronous save is committed when it returns; an
asynchronous one returns once its tensors are staged in host memory and commits in the background
(``handle.wait()``), in call order."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from bcp.adapters import adapter_for
from bcp.api.gc_pause import paused_gc
from bcp.api.components import RESHARDED, check_keys, collect
from bcp.api.location import resolve
from bcp.api.results import PhaseStats, SaveHandle
from bcp.coord import Coordinator, default_coordinator
from bcp.coord.consensus import Outcome, all_agree, gather_then_reply
from bcp.engine import background
from bcp.engine.bytes_of import byte_view, host_contiguous
from bcp.engine.checksum import crc_of
from bcp.engine.commit import build_manifest
from bcp.engine.location import Location
from bcp.engine.staging import HostBufferPool, stage, staged_nbytes
from bcp.engine.writer import PieceWrite, piece_writes, write_rank
from bcp.layout.manifest import DEFAULT_CHECKSUM_CHUNK
from bcp.layout.values import EncodedValue, encode_value
from bcp.layout.shards import is_tensor_value
from bcp.planning.pieces import Piece, pieces_of, tensor_meta
from bcp.planning.plan_cache import CachedPlan, PlanCache
from bcp.planning.save_plan import PlanColumns, global_plan, local_plan, structure_key
from bcp.storage import Storage
from bcp.version import __version__

DEFAULT_IO_THREADS = 4

_plan_cache = PlanCache()
_buffers = HostBufferPool(max_sets=2)
_last_generation: dict[tuple[str, str], int] = {}  # generations handed out by this process, per location


def save(
    path: "str | os.PathLike | Storage",
    state: Mapping[str, Any],
    *,
    framework: str | None = None,
    async_save: bool = False,
    role: str | None = None,
    coordinator: Coordinator | None = None,
    allow_pickle: bool = False,
    verify_replicas: bool = False,
    io_threads: int = DEFAULT_IO_THREADS,
) -> SaveHandle:
    """Save ``state`` (a dict of components) to ``path``; every rank calls it with its own objects.

    ``model``/``optimizer`` are saved resharding-ready; other components are saved per rank.
    With ``async_save`` the call returns once the state is copied to host buffers; the handle's
    ``wait()`` returns when it is committed (and raises if it failed). ``allow_pickle`` lets values
    outside the safe encoding be pickled (the checkpoint is then marked unsafe); ``verify_replicas``
    checks, by checksum, that replicated tensors agree across ranks.
    """
    check_keys(state)
    with paused_gc():
        return _save(path, state, framework, async_save, role, coordinator or default_coordinator(),
                     allow_pickle, verify_replicas, io_threads)


def _save(path: "str | os.PathLike | Storage", state: Mapping[str, Any], framework: str | None,
          async_save: bool, role: str | None, coord: Coordinator, allow_pickle: bool, verify_replicas: bool,
          io_threads: int) -> SaveHandle:
    location = resolve(path, role)
    stats = PhaseStats()
    with stats.phase("collect"):
        adapter = adapter_for(state, framework) if any(k in state for k in RESHARDED) else None
        collected = Outcome.of(lambda: _collect(state, adapter, allow_pickle, verify_replicas))
    with stats.phase("plan"):
        generation, cached = _agree_on_plan(coord, location, collected, cache=not verify_replicas)
    objects = collected.value.objects
    writes = piece_writes(collected.value.pieces, cached.writes)
    framework_name = adapter.name if adapter else "none"

    if not async_save:
        _write_and_commit(coord, location, generation, writes, objects, cached, framework_name, io_threads, stats)
        return SaveHandle(location.display, generation, stats)

    background_coord = coord.sibling()  # collective: before the background thread needs it
    with stats.phase("stage"):
        buffer = _buffers.acquire(staged_nbytes(writes))
        try:
            writes = stage(writes, buffer)
        except BaseException:
            _buffers.release(buffer)
            raise

    def job() -> None:
        try:
            _write_and_commit(background_coord, location, generation, writes, objects, cached,
                              framework_name, io_threads, stats)
        finally:
            _buffers.release(buffer)

    return SaveHandle(location.display, generation, stats, background.submit(job))


def wait_pending_saves() -> None:
    """Block until every asynchronous save of this process has committed or failed."""
    background.wait_pending()


@dataclass
class _Collected:
    """A rank's state as the planner sees it: tensor declarations, pieces and encoded values, and
    the structure key the plan cache compares."""

    tensors: list[tuple[str, Any, tuple[int, ...]]]
    pieces: list[Piece]
    objects: list[tuple[str, EncodedValue]]
    replica_crcs: list[int] | None
    structure: tuple

    def local_plan(self) -> list[Any]:
        return local_plan(self.tensors, self.pieces, self.replica_crcs)


def _collect(state: Mapping[str, Any], adapter: Any, allow_pickle: bool, verify_replicas: bool) -> _Collected:
    tensors: list[tuple[str, Any, tuple[int, ...]]] = []
    pieces: list[Piece] = []
    objects: list[tuple[str, EncodedValue]] = []
    for name, value in collect(state, adapter, for_load=False).items():
        if name.split("/", 1)[0] in RESHARDED and is_tensor_value(value):
            tensors.append((name, *tensor_meta(name, value)))
            pieces.extend(pieces_of(name, value))
        else:
            objects.append((name, encode_value(value, key=name, allow_pickle=allow_pickle)))
    crcs = [crc_of(byte_view(host_contiguous(p.tensor))) for p in pieces] if verify_replicas else None
    return _Collected(tensors, pieces, objects, crcs, structure_key(tensors, pieces))


def _agree_on_plan(coord: Coordinator, location: Location, collected: Outcome,
                   cache: bool) -> tuple[int, CachedPlan]:
    """The generation to write and this rank's share of the global plan. When every rank's
    structure is unchanged since the previous save, the cached global plan is reused after one
    small exchange (every rank's hit flag, and rank 0's generation, to every rank); otherwise local
    plans are gathered and planned again."""
    key = coord.cache_key()
    structure = collected.value.structure if cache and collected.error is None else None
    hit = _plan_cache.get(key, structure) if structure is not None else None
    what = f"planning the save of {location.display}"

    def propose() -> list[Any]:
        if collected.error is not None:
            raise collected.error
        return [hit is not None, _next_generation(location) if coord.rank == 0 else None]

    proposals = all_agree(coord, Outcome.of(propose), what)
    generation = proposals[0][1]
    if all(flag for flag, _ in proposals):
        return generation, hit
    kept: dict[str, Any] = {}

    def plan_globally(plans: list[Any]) -> list[Any]:
        kept["columns"] = columns = PlanColumns(plans)
        return global_plan(columns)

    writes = gather_then_reply(coord, Outcome.of(collected.value.local_plan), plan_globally, what)
    planned = CachedPlan(structure, writes, kept.get("columns"))
    if cache:
        _plan_cache.put(key, planned)
    return generation, planned


def _next_generation(location: Location) -> int:
    """Above every generation on storage and every one this process handed out: an asynchronous
    save may not have created its folder yet when the next save asks."""
    key = (location.storage.root, location.prefix)
    generation = max(location.next_generation(), _last_generation.get(key, 0) + 1)
    _last_generation[key] = generation
    return generation


def _write_and_commit(coord: Coordinator, location: Location, generation: int, writes: list[PieceWrite],
                      objects: list[tuple[str, EncodedValue]], plan: CachedPlan, framework: str,
                      io_threads: int, stats: PhaseStats) -> None:
    with stats.phase("write"):
        written = Outcome.of(lambda: write_rank(location, generation, coord.rank, writes, objects, io_threads,
                                                DEFAULT_CHECKSUM_CHUNK))
    stats.bytes = written.value.nbytes if written.error is None else 0
    if written.error is None:
        written.value = written.value.to_wire()

    def commit(all_writes: list[Any]) -> list[Any]:
        with paused_gc():  # on the background thread of an async save, the foreground's pause is over
            manifest = build_manifest(generation=generation, framework=framework,
                                      checksum_chunk=DEFAULT_CHECKSUM_CHUNK, writer=f"bcp {__version__}",
                                      columns=plan.columns, writes=all_writes)
        location.commit(generation, manifest)
        location.remove_older_than(generation)
        return [None] * coord.world_size

    with stats.phase("commit"):
        gather_then_reply(coord, written, commit, f"writing the checkpoint {location.display}")
