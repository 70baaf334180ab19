"""``bcp.save``: every rank calls it. A synchronous save is committed when it returns; an
asynchronous one returns once its tensors are staged in host memory and commits in the background
(``handle.wait()``), in call order."""

from __future__ import annotations

import os
from typing import Any, Mapping

from bcp.adapters import adapter_for
from bcp.api.components import RESHARDED, check_keys, collect
from bcp.api.location import resolve
from bcp.api.results import PhaseStats, SaveHandle
from bcp.coord import Coordinator, default_coordinator
from bcp.coord.consensus import Outcome, gather_then_reply
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
from bcp.planning.save_plan import global_plan, local_plan, plan_digest
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
    coord = coordinator or default_coordinator()
    location = resolve(path, role)
    stats = PhaseStats()
    adapter = adapter_for(state, framework) if any(k in state for k in RESHARDED) else None

    with stats.phase("plan"):
        prepared = Outcome.of(lambda: _prepare(state, adapter, allow_pickle, verify_replicas))
        pieces, objects, plan = prepared.value if prepared.error is None else ([], [], None)
        generation, cached = _agree_on_plan(coord, location, plan, prepared.error, cache=not verify_replicas)
    writes = piece_writes(pieces, cached.writes)
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


def _prepare(state: Mapping[str, Any], adapter: Any, allow_pickle: bool,
             verify_replicas: bool) -> tuple[list[Piece], list[tuple[str, EncodedValue]], list[Any]]:
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
    return pieces, objects, local_plan(tensors, pieces, crcs)


def _agree_on_plan(coord: Coordinator, location: Location, plan: list[Any] | None,
                   error: BaseException | None, cache: bool) -> tuple[int, CachedPlan]:
    """The generation to write and this rank's share of the global plan. When every rank's plan
    is unchanged since the previous save, the cached global plan is reused after one small
    exchange; otherwise local plans are gathered and planned again."""
    key = coord.cache_key()
    digest = plan_digest(plan) if plan is not None else b""
    hit = _plan_cache.get(key, digest) if cache else None
    what = f"planning the save of {location.display}"

    def agree(flags: list[bool]) -> list[Any]:
        return [[_next_generation(location), all(flags)]] * coord.world_size

    generation, reuse = gather_then_reply(coord, Outcome(hit is not None, error), agree, what)
    if reuse:
        return generation, hit
    kept: dict[str, Any] = {}

    def plan_globally(plans: list[Any]) -> list[Any]:
        kept["plans"] = plans
        return global_plan(plans)

    writes = gather_then_reply(coord, Outcome(plan), plan_globally, what)
    planned = CachedPlan(digest, writes, kept.get("plans"))
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
        manifest = build_manifest(generation=generation, framework=framework,
                                  checksum_chunk=DEFAULT_CHECKSUM_CHUNK, writer=f"bcp {__version__}",
                                  local_plans=plan.local_plans, writes=all_writes)
        location.commit(generation, manifest)
        location.remove_older_than(generation)
        return [None] * coord.world_size

    with stats.phase("commit"):
        gather_then_reply(coord, written, commit, f"writing the checkpoint {location.display}")
