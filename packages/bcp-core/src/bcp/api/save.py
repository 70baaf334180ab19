"""``bcp.save``: every rank calls it. A synchronous save is committed when it returns; an
asynchronous one returns once its tensors are staged in host memory and commits in the background
(``handle.wait()``), in call order.

The phases: collect (the adapter turns the state into tensor pieces and encoded values), plan (the
global plan, reused from the plan cache when nothing changed), stage (asynchronous saves only: the
pieces are copied to host buffers), then the writer door (write, commit)."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from bcp.adapters.dataloader import COMPONENT as DATALOADER
from bcp.adapters.dataloader import DataloaderState, check_writers
from bcp.api.components import check_keys, collect
from bcp.api.gc_pause import paused_gc
from bcp.api.location import resolve
from bcp.api.metrics import Monitor
from bcp.api.options import SaveOptions
from bcp.api.results import PhaseStats, SaveHandle
from bcp.api.runtime import Runtime, runtime
from bcp.api.targets import CheckpointTarget
from bcp.api.writing import commit_generation, write_share
from bcp.coord import Coordinator, as_coordinator
from bcp.coord.consensus import Outcome, all_agree, broadcast_from_root, gather_then_reply
from bcp.engine.bytes_of import byte_view, host_contiguous
from bcp.engine.checksum import crc_of
from bcp.engine.chunked_copies import ChunkedCopies
from bcp.engine.location import Location
from bcp.engine.staging import stage, staged_nbytes
from bcp.engine.writer import GenerationWriter, InProcess
from bcp.engine.writer_process import storage_for_process
from bcp.errors import CheckpointError
from bcp.layout.local_plan import LocalPlan
from bcp.layout.manifest import DEFAULT_CHECKSUM_CHUNK, Manifest
from bcp.layout.piece import Piece
from bcp.layout.shards import is_tensor_value
from bcp.layout.references import generation_dir
from bcp.layout.write_plan import RankAssignment, ValueWrite
from bcp.layout.write_report import RankWrites
from bcp.planning import plain_tensors
from bcp.planning.assembly import assemble_manifest
from bcp.planning.pieces import pieces_of, tensor_meta
from bcp.planning.plain_tensors import PlainTensor
from bcp.planning.plan_cache import CachedPlan
from bcp.planning.reuse import FrozenParameters, Remembered, Reuse, decide, stored_boxes
from bcp.planning.save_plan import PlanColumns, global_plan, structure_key, writes_of
from bcp.planning.shared_values import digests, encoded_value, values_to_write
from bcp.storage import Storage
from bcp.version import __version__

logger = logging.getLogger("bcp")


def save(path: "str | os.PathLike | Storage | CheckpointTarget", state: Mapping[str, Any],
         options: SaveOptions | None = None, **keywords: Any) -> SaveHandle:
    """Save ``state`` (a dict of components) to ``path``; every rank calls it with its own objects.

    Modules, optimizers and sharded tensors anywhere in the (nested) state are saved
    resharding-ready; other values are saved per rank (``docs/architecture.md``). ``path`` may also be
    a :class:`bcp.MemoryTier` (node memory, replicated to peers, persisted every k-th save).
    ``options`` (:class:`SaveOptions`), or its fields as keywords: ``async_save`` returns once the
    state is copied to host memory and the handle's ``wait()`` returns when it is committed (and
    raises if it failed); ``allow_pickle`` lets values outside the safe encoding be pickled (the
    checkpoint is then marked unsafe); ``verify_replicas`` checks, by checksum, that replicated
    tensors agree across ranks; ``framework``, ``role``, ``coordinator``, ``io_threads``.
    """
    options = (options or SaveOptions()).merged(keywords)
    if isinstance(path, CheckpointTarget):  # a bcp.MemoryTier: it decides where the save goes
        return path.save_state(state, options)
    return save_at(path, lambda: resolve(path, options.role, options.keep_generations), state, options,
                   commit_generation)


#: The commit barrier of a save (``api.writing.commit_generation``'s signature): every rank's write
#: report in, the verdict out on every rank.
Commit = Callable[[Coordinator, GenerationWriter, Outcome, Callable[[list[RankWrites]], Manifest], PhaseStats,
                   "Monitor | None"], None]


def save_at(path: Any, locate: Callable[[], Location], state: Mapping[str, Any], options: SaveOptions,
            commit: Commit) -> SaveHandle:
    """Collective: ``bcp.save`` into the location ``locate()`` gives (called on every rank), committed
    by ``commit`` (sync: on this thread; async: on the background lane's commit thread, with the
    sibling coordinator). ``path`` is what the caller named, for the metrics record."""
    check_keys(state)
    if options.async_writer not in ("process", "threads"):
        raise CheckpointError(f"async_writer must be 'process' or 'threads', not {options.async_writer!r}")
    coord = as_coordinator(options.coordinator)
    stats = PhaseStats()
    monitor = Monitor("save", coord.rank, coord.world_size, stats, options.topology, options.metrics_log,
                      options.summary_log_level)
    with paused_gc():
        try:
            return _save(path, locate, state, options, coord, runtime(), stats, monitor, commit)
        except BaseException as exc:
            monitor.fail(None, exc)  # no-op where the writer door recorded it, and on ranks other than 0
            raise


def wait_pending_saves() -> None:
    """Block until every asynchronous save of this process has committed or failed."""
    runtime().background.wait_pending()


@dataclass(slots=True)
class _Collected:
    """A rank's state as the planner sees it: tensor declarations, pieces and value records, the
    plain tensors (tensor entries or per-rank tensors, decided with every rank's digests) and the
    structure key the plan cache compares."""

    tensors: list[tuple[str, Any, tuple[int, ...]]]
    pieces: list[Piece]
    values: list[ValueWrite]
    plain: list[PlainTensor]
    replica_crcs: list[int] | None
    structure: tuple
    framework: str
    #: The rank's word on its dataloader parts (``DataloaderState.declaration``), None without one.
    dataloader: list[int] | None
    #: An incremental save's frozen parameters (``planning.reuse``), None where they are not trusted.
    frozen: FrozenParameters | None = None

    def with_entries(self, entries: set[str]) -> "_Share":
        """Everything this rank plans once the plain tensors in ``entries`` are tensor entries."""
        chosen = [t for t in self.plain if t.name in entries]
        pieces = [p for t in chosen for p in pieces_of(t.name, t.tensor)]
        crcs = [None] * len(self.pieces) + [t.crcs for t in chosen if t.tensor.numel()]
        replica_crcs = None if self.replica_crcs is None else \
            self.replica_crcs + [t.digest & 0xFFFFFFFF for t in chosen if t.tensor.numel()]
        per_rank = [plain_tensors.per_rank_value(t) for t in self.plain if t.name not in entries]
        return _Share(self.tensors + [(t.name, t.tensor.dtype, tuple(t.tensor.shape)) for t in chosen],
                      self.pieces + pieces, crcs, replica_crcs, self.values + per_rank)


@dataclass(slots=True)
class _Share:
    """What a rank plans and writes: declarations and pieces (each with its chunk checksums where
    known), and value records."""

    tensors: list[tuple[str, Any, tuple[int, ...]]]
    pieces: list[Piece]
    crcs: list[list[int] | None]
    replica_crcs: list[int] | None
    values: list[ValueWrite]

    def local_plan(self) -> list[Any]:
        return LocalPlan.of(self.tensors, self.pieces, self.replica_crcs).to_wire()


def _save(path: Any, locate: Callable[[], Location], state: Mapping[str, Any], options: SaveOptions,
          coord: Coordinator, rt: Runtime, stats: PhaseStats, monitor: Monitor, commit: Commit) -> SaveHandle:
    monitor.begin(path)
    monitor.location = location = locate()
    epoch = rt.reuse.epoch  # before the tensors are seen: a load from now on makes this save's view stale
    with stats.phase("collect"):
        collected = Outcome.of(lambda: _collect(state, options, location.display))
    with stats.phase("plan"):
        with stats.phase("plan.exchange"):
            generation, plan, share, value_digests, base = _agree_on_plan(
                coord, location, collected, rt, not options.verify_replicas, options.incremental)
        monitor.generation = generation
        with stats.phase("plan.writes"):  # identical values are written once: hashing them takes time
            pieces = writes_of(share.pieces, plan.writes, share.crcs)
            place = (location.target, coord.cache_key())
            boxes = _base_boxes(coord, location, rt, place, base, {p.name for p in share.pieces})
            reuse = decide(pieces, share.pieces, boxes, collected.value.frozen, generation, DEFAULT_CHECKSUM_CHUNK) \
                if options.incremental else None
            manifest_of = _manifest_builder(generation, collected.value.framework, plan, options.step)
            values = values_to_write(coord.rank, share.values, value_digests)
    on_report = None
    if reuse is not None:
        pieces = reuse.written
        stats.reused_bytes = reuse.reused_nbytes

        def on_report(report: RankWrites) -> None:
            reuse.complete(report)
            rt.reuse.remember(place, generation, reuse.remembered(report, generation_dir(generation)), epoch)
    tensors = [piece.tensor() for piece in pieces]
    copies = ChunkedCopies(rt.chunks, tensors)  # here: device copies follow the work queued so far
    if not options.async_save:
        writer = GenerationWriter(location, generation, threads=options.io_threads, copies=copies)
        commit(coord, writer, write_share(coord.rank, writer, pieces, values, stats, monitor=monitor,
                                          on_report=on_report), manifest_of, stats, monitor)
        return SaveHandle(location.display, generation, stats, monitor=monitor)

    with stats.phase("stage"):  # everything the training thread does before it gets control back
        background_coord = coord.sibling()  # collective: before the background thread needs it
        values = [value.snapshot() for value in values]  # the state may change once save returns
        buffer = rt.buffers.acquire(staged_nbytes(pieces))
        try:
            pieces = stage(pieces, buffer, copies)
        except BaseException:
            rt.buffers.release(buffer)
            raise
    # A buffer that takes copies from the accelerator is worth page-locking, for that device.
    copied_from = next((tensor.device for tensor in tensors if copies.holds(tensor)), None)
    writer = GenerationWriter(location, generation, threads=options.io_threads, background=True,
                              abandon=rt.background.abandon, in_process=_in_process(rt, location, buffer, options))
    monitor.returned()  # the caller gets control back: the blocking time ends here

    handed_over = stats.now()

    def write() -> Outcome:
        # "queue": the wait for the lane's threads, long where an earlier save still writes or commits
        stats.add("queue", handed_over, stats.now())
        try:
            return write_share(background_coord.rank, writer, pieces, values, stats, monitor=monitor,
                               on_report=on_report)
        finally:  # durable: the next save may stage into it, whatever the barrier does
            rt.buffers.release(buffer, copied_from=copied_from)

    def commit_in_background(report: Outcome) -> None:
        stats.add("queue", stats.spans[-1][2], stats.now())  # from the end of this save's write
        commit(background_coord, writer, report, manifest_of, stats, monitor)

    job = rt.background.submit(write, commit_in_background, label=f"{location.display} (generation {generation})")
    return SaveHandle(location.display, generation, stats, job, monitor)


def _in_process(rt: Runtime, location: Location, buffer: Any, options: SaveOptions) -> InProcess | None:
    """The writer process's part in an asynchronous save, where it takes it (``async_writer``)."""
    if options.async_writer == "threads":
        return None
    shared = rt.buffers.shared_of(buffer)
    storage = storage_for_process(location.storage) if shared is not None else None
    if storage is None:
        return None
    try:
        process = rt.background.writer_process()
    except OSError as exc:  # no process can be started here (limits, a sandbox): threads write
        logger.warning("bcp: the writer process could not be started (%s); writing from threads", exc)
        return None
    return InProcess(process, storage, shared, rt.buffers.shared_ids())


def _collect(state: Mapping[str, Any], options: SaveOptions, path: str) -> _Collected:
    """The adapter's view of the state: pieces of the resharded components' tensors, and every other
    value encoded (and copied, so an asynchronous save is unaffected by later changes)."""
    try:
        return _collected(state, options)
    except CheckpointError as exc:
        raise exc.at(path)


def _collected(state: Mapping[str, Any], options: SaveOptions) -> _Collected:
    collected = collect(state, options.framework, for_load=False)
    tensors: list[tuple[str, Any, tuple[int, ...]]] = []
    pieces: list[Piece] = []
    values: list[ValueWrite] = []
    plain: list[PlainTensor] = []
    copies = ChunkedCopies(runtime().chunks)  # on this thread: device reads follow the work queued so far

    def held(name: str, tensor: torch.Tensor) -> None:  # a tensor a value holds: saved as one
        plain.append(PlainTensor.of(name, tensor, DEFAULT_CHECKSUM_CHUNK, copies))

    for name, value in collected.values.items():
        if name in collected.plain:
            held(name, value)
        elif name in collected.resharded and is_tensor_value(value):
            tensors.append((name, *tensor_meta(name, value)))
            pieces.extend(pieces_of(name, value))
        else:
            values.append(encoded_value(name, value, allow_pickle=options.allow_pickle, chunk=DEFAULT_CHECKSUM_CHUNK,
                                        extract=held if name in collected.per_rank else None))
    crcs = [crc_of(byte_view(host_contiguous(p.tensor))) for p in pieces] if options.verify_replicas else None
    loader = state.get(DATALOADER)
    declared = tensors + [(t.name, t.tensor.dtype, tuple(t.tensor.shape)) for t in plain]
    frozen = FrozenParameters.of(bound.obj for _, parts in collected.modules for bound in parts
                                 if isinstance(bound.obj, nn.Module)) if options.incremental and options.trust_frozen \
        else None
    return _Collected(tensors, pieces, values, plain, crcs, structure_key(declared, pieces), collected.framework,
                      loader.declaration() if isinstance(loader, DataloaderState) else None, frozen)


@dataclass(frozen=True, slots=True)
class _Proposal:
    """A rank's word on the plan: whether its cached plan still fits (and for which kinds of plain
    tensors it was made), (rank 0) the generation, a digest of the checkpoint it names and what it
    declares of its dataloader parts (the last two checked by every rank before anything is
    written), a digest of each of its per-rank values (identical ones are written once,
    ``planning.shared_values``) and of each of its plain tensors (``planning.plain_tensors``). For
    an incremental save: (rank 0) the base generation and whether its claim was this process's, and
    the generations this rank remembers saving at the path (``planning.reuse_memory``)."""

    cache_hit: bool
    cached_kinds: int | None
    generation: int | None
    target_digest: int
    dataloader: list[int] | None
    values: list[list[Any]]
    plain: list[list[Any]]
    base: int | None = None
    continuous: bool = False
    remembered: list[int] | None = None

    def to_wire(self) -> list[Any]:
        return [self.cache_hit, self.cached_kinds, self.generation, self.target_digest, self.dataloader, self.values,
                self.plain, self.base, self.continuous, self.remembered]

    @staticmethod
    def from_wire(wire: list[Any]) -> "_Proposal":
        return _Proposal(*wire)


@dataclass(frozen=True, slots=True)
class _Base:
    """An incremental save's base: the newest committed generation at the path when the save
    claimed its own (None: there is none, or the save is not incremental), and whether every rank
    remembers what it stored there (else the base's manifest says)."""

    generation: int | None = None
    remembered: bool = False


def _claim(location: Location, rt: Runtime, incremental: bool) -> tuple[int, int | None, bool]:
    """(Rank 0) the generation claimed, the base of an incremental save, and whether the base's
    claim is one this process made (its saves' memory is then the base's)."""
    base = location.newest_committed() if incremental else None
    generation, token = location.claim(base)
    if not incremental:
        return generation, None, False
    rt.reuse.claimed(location.target, generation, token)
    mine = rt.reuse.claim_token(location.target, base) if base is not None else None
    return generation, base, mine is not None and mine == location.claim_token(base)


def _agree_on_plan(coord: Coordinator, location: Location, collected: Outcome, rt: Runtime, cache: bool,
                   incremental: bool) -> tuple[int, CachedPlan, _Share, list[list[list[Any]]], _Base]:
    """The generation to write, this rank's share of the global plan (and what it plans), every
    rank's value digests and an incremental save's base. Which plain tensors are tensor entries
    follows from every rank's digests of them. When every rank's structure is unchanged since the
    previous save, and its plain tensors are of the same kinds, the cached global plan is reused
    after one small exchange (every rank's hit flag, and rank 0's generation, to every rank);
    otherwise local plans are gathered and planned again."""
    key = coord.cache_key()
    structure = collected.value.structure if cache and collected.error is None else None
    hit = rt.plan_cache.get(key, structure) if structure is not None else None
    what = f"planning the save of {location.display}"

    def propose() -> list[Any]:
        if collected.error is not None:
            raise collected.error
        generation, base, continuous = _claim(location, rt, incremental) if coord.rank == 0 else (None, None, False)
        return _Proposal(hit is not None, hit.kinds if hit is not None else None, generation,
                         _digest(location.target), collected.value.dataloader,
                         digests(collected.value.values), plain_tensors.digests(collected.value.plain),
                         base, continuous, rt.reuse.generations((location.target, key))).to_wire()

    proposals = [_Proposal.from_wire(wire) for wire in all_agree(coord, Outcome.of(propose), what)]
    try:  # every rank holds every proposal, so every rank raises the same error here
        if len({proposal.target_digest for proposal in proposals}) > 1:  # every rank sees it: collective
            _refuse_targets(all_agree(coord, Outcome(location.target), what))
        check_writers([proposal.dataloader for proposal in proposals])
    except CheckpointError as exc:
        raise exc.at(location.display)
    generation, base = proposals[0].generation, proposals[0].base
    base = _Base(base, base is not None and proposals[0].continuous and all(base in p.remembered for p in proposals))
    entries = plain_tensors.same_everywhere([proposal.plain for proposal in proposals])
    kinds = plain_tensors.kinds_digest(entries)
    value_digests = [proposal.values + [pair for pair in proposal.plain if pair[0] not in entries]
                     for proposal in proposals]
    share = Outcome.of(lambda: collected.value.with_entries(entries))
    if share.error is None and all(proposal.cache_hit and proposal.cached_kinds == kinds for proposal in proposals):
        return generation, hit, share.value, value_digests, base
    kept: dict[str, PlanColumns] = {}

    def plan_globally(plans: list[Any]) -> list[Any]:
        kept["columns"] = columns = PlanColumns([LocalPlan.from_wire(plan) for plan in plans])
        return [assignment.to_wire() for assignment in global_plan(columns)]

    local = Outcome.of(lambda: share.value.local_plan()) if share.error is None else share
    wire = gather_then_reply(coord, local, plan_globally, what)
    planned = CachedPlan(structure, RankAssignment.from_wire(wire), kept.get("columns"), kinds)
    if cache:
        rt.plan_cache.put(key, planned)
    return generation, planned, share.value, value_digests, base


def _base_boxes(coord: Coordinator, location: Location, rt: Runtime, place: Any, base: _Base,
                names: set[str]) -> dict[Any, Remembered]:
    """The boxes of the tensors ``names`` that the base stores: from this process's memory of the
    save that wrote it where every rank has one, else (collective) from its manifest."""
    if base.generation is None:
        return {}
    if base.remembered:
        boxes = rt.reuse.recalled(place, base.generation) or {}
    else:
        manifest = _base_manifest(coord, location, base.generation)
        boxes = stored_boxes(manifest, names) if manifest is not None else {}
    usable = {file: location.may_refer_to(file) for file in {box.stored.file for box in boxes.values()}}
    return boxes if all(usable.values()) else {key: box for key, box in boxes.items() if usable[box.stored.file]}


def _base_manifest(coord: Coordinator, location: Location, generation: int) -> Manifest | None:
    """Collective: the base's manifest, read by rank 0 and sent to every rank, as a load opens it.
    None where it cannot be read (removed meanwhile, damaged): the save then writes everything."""
    where = f"{location.display}/{generation_dir(generation)}"

    def read() -> list[bytes] | None:
        try:
            return list(location.read_manifest_files(generation))
        except CheckpointError as exc:
            logger.warning("bcp: the incremental save cannot read its base %s, so it writes everything: %s",
                           where, exc)
            return None

    files = broadcast_from_root(coord, Outcome.of(read) if coord.rank == 0 else Outcome(),
                                f"reading the base of the incremental save of {location.display}")
    if files is None:
        return None
    try:
        return Manifest.decode(files[0], files[1], path=where)
    except CheckpointError as exc:  # the same on every rank: every rank writes everything
        logger.warning("bcp: the base of the incremental save, %s, is damaged, so it writes everything: %s", where, exc)
        return None


def _digest(target: str) -> int:
    """The checkpoint a rank names, in 8 bytes: what every save's plan exchange carries (the names
    themselves travel only when the digests differ)."""
    return int.from_bytes(hashlib.blake2b(target.encode(), digest_size=8).digest(), "big")


def _refuse_targets(targets: list[str]) -> None:
    """Every rank must name the same checkpoint: ranks writing their shares to different places would
    commit a generation whose files are elsewhere (found only when it is loaded)."""
    named = {target: [rank for rank, t in enumerate(targets) if t == target] for target in targets}
    listed = "; ".join(f"ranks {ranks}: {target}" for target, ranks in named.items())
    raise CheckpointError(f"the ranks of one save name different checkpoints ({listed}): every rank "
                          "must pass the same path or URL (and role)")


def _manifest_builder(generation: int, framework: str, plan: CachedPlan,
                      step: int | None) -> Callable[[list[RankWrites]], Manifest]:
    def manifest_of(reports: list[RankWrites]) -> Manifest:
        manifest = assemble_manifest(generation=generation, framework=framework, checksum_chunk=DEFAULT_CHECKSUM_CHUNK,
                                     writer=f"bcp {__version__}", columns=plan.columns, reports=reports)
        manifest.step = step
        return manifest
    return manifest_of
