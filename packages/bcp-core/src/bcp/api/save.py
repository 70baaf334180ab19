"""``bcp.save``: every rank calls it. A synchronous save is committed when it returns; an
asynchronous one returns once its tensors are staged in host memory and commits in the background
(``handle.wait()``), in call order.

The phases: collect (the adapter turns the state into tensor pieces and encoded values), plan (the
global plan, reused from the plan cache when nothing changed), stage (asynchronous saves only: the
pieces are copied to host buffers, or where the target stages them: a memory tier, into its new
generation's files), then the writer door (write, commit)."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn

from bcp.adapters.dataloader import COMPONENT as DATALOADER
from bcp.adapters.dataloader import DataloaderState
from bcp.api.components import check_keys, collect
from bcp.api.gc_pause import paused_gc
from bcp.api.location import resolve
from bcp.api.metrics import Monitor
from bcp.api.options import SaveOptions
from bcp.api.plan_agreement import AgreedPlan, Base, Collected, PlannedPiece, agree_on_plan
from bcp.api.results import PhaseStats, SaveHandle
from bcp.api.runtime import Runtime, runtime
from bcp.api.targets import CheckpointTarget
from bcp.api.writing import commit_generation, write_share
from bcp.coord import Coordinator, as_coordinator
from bcp.coord.consensus import Outcome, broadcast_from_root
from bcp.engine.bytes_of import byte_view, host_contiguous
from bcp.engine.checksum import crc_of
from bcp.engine.chunked_copies import ChunkedCopies
from bcp.engine.location import Location
from bcp.engine.snapshot_copy import SnapshotCopy
from bcp.engine.staging import copy_in, place, staged_nbytes
from bcp.engine.writer import GenerationWriter, InProcess
from bcp.engine.writer_process import storage_for_process
from bcp.errors import CheckpointError
from bcp.layout.manifest import DEFAULT_CHECKSUM_CHUNK, Manifest
from bcp.layout.piece import Piece
from bcp.layout.shards import is_dtensor, is_tensor_value
from bcp.layout.references import generation_dir
from bcp.layout.write_plan import PieceWrite, ValueWrite
from bcp.layout.write_report import RankWrites
from bcp.planning.assembly import assemble_manifest
from bcp.planning.pieces import pieces_of, tensor_meta
from bcp.planning.plain_tensors import PlainTensor
from bcp.planning.plan_cache import CachedPlan
from bcp.planning.reuse import FrozenParameters, Remembered, Reuse, decide, stored_boxes
from bcp.planning.save_plan import structure_key, writes_of
from bcp.planning.shared_values import encoded_value, values_to_write
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
    raises if it failed); with ``overlap`` too it returns before the parameters and optimizer state
    are copied, which the next step's forward and backward overlap (``SaveOptions.overlap``);
    ``allow_pickle`` lets values outside the safe encoding be pickled (the
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


class Staging(Protocol):
    """Where an asynchronous save of one rank stages its pieces, and what writes them from there."""

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` the pieces are copied into (``staging.place``)."""

    def release(self, buffer: torch.Tensor, *, copied_from: torch.device | None = None) -> None:
        """The save's writes from ``buffer`` are done (or failed)."""

    def writer(self, buffer: torch.Tensor, abandon: threading.Event) -> GenerationWriter:
        """The writer of the save's generation, writing the pieces staged in ``buffer``."""


#: The staging of a target that stages in its own way (a memory tier, in its new generation's files),
#: made for each asynchronous save from the process's runtime, the location, the generation and the rank.
StageIn = Callable[[Runtime, Location, int, int], Staging]


def save_at(path: Any, locate: Callable[[], Location], state: Mapping[str, Any], options: SaveOptions,
            commit: Commit, stage_in: StageIn | None = None) -> SaveHandle:
    """Collective: ``bcp.save`` into the location ``locate()`` gives (called on every rank), committed
    by ``commit`` (sync: on this thread; async: on the background lane's commit thread, with the
    sibling coordinator, staged by ``stage_in``'s staging where given, else in the runtime's pool).
    ``path`` is what the caller named, for the metrics record."""
    check_keys(state)
    if options.async_writer not in ("process", "threads"):
        raise CheckpointError(f"async_writer must be 'process' or 'threads', not {options.async_writer!r}")
    if options.overlap and not options.async_save:
        raise CheckpointError("overlap=True overlaps an asynchronous save's copy with training: pass async_save=True "
                              "too", path=str(path))
    if options.compression is False:  # "none", named so that a target's own did not replace it: none
        options = replace(options, compression=None)
    runtime().background.snapshots.wait()  # an overlapped save's copy may still read the tensors
    coord = as_coordinator(options.coordinator)
    stats = PhaseStats()
    monitor = Monitor("save", coord.rank, coord.world_size, stats, options.topology, options.metrics_log,
                      options.summary_log_level)
    with paused_gc():
        try:
            return _save(path, locate, state, options, coord, runtime(), stats, monitor, commit, stage_in)
        except BaseException as exc:
            monitor.fail(None, exc)  # no-op where the writer door recorded it, and on ranks other than 0
            raise


def wait_pending_saves() -> None:
    """Block until every asynchronous save of this process has committed or failed."""
    runtime().background.snapshots.wait()
    runtime().background.wait_pending()


def _save(path: Any, locate: Callable[[], Location], state: Mapping[str, Any], options: SaveOptions,
          coord: Coordinator, rt: Runtime, stats: PhaseStats, monitor: Monitor, commit: Commit,
          stage_in: StageIn | None) -> SaveHandle:
    """The steps: collect, plan (agree on it, then resolve this rank's writes), then write now
    (synchronous) or stage and hand the writes to the background lane (asynchronous)."""
    monitor.begin(path)
    monitor.location = location = locate()
    epoch = rt.reuse.epoch  # before the tensors are seen: a load from now on makes this save's view stale
    place = (location.target, coord.cache_key())  # the path and group, as the reuse memory knows them
    with stats.phase("collect"):
        outcome = Outcome.of(lambda: _collect(state, options, location.display))
    collected = Outcome(outcome.value and outcome.value[0], outcome.error)
    stepped = outcome.value[1] if outcome.value else None  # with overlap: what the optimizers write
    with stats.phase("plan"):
        with stats.phase("plan.exchange"):
            agreed = agree_on_plan(coord, location, place, collected, rt, not options.verify_replicas,
                                   options.incremental)
        monitor.generation = agreed.generation
        with stats.phase("plan.writes"):  # identical values are written once: hashing them takes time
            writes = _rank_writes(coord, location, place, rt, agreed, collected.value, options, epoch)
    stats.reused_bytes = writes.reused_nbytes
    tensors = [piece.tensor() for piece in writes.pieces]
    copies = ChunkedCopies(rt.chunks, tensors)  # here: device copies follow the work queued so far
    if not options.async_save:
        writer = GenerationWriter(location, agreed.generation, threads=options.io_threads, copies=copies,
                                  compression=options.compression)
        commit(coord, writer, write_share(coord.rank, writer, writes.pieces, writes.values, stats, monitor=monitor,
                                          on_report=writes.on_report), writes.manifest_of, stats, monitor)
        return SaveHandle(location.display, agreed.generation, stats, monitor=monitor)
    label = f"{location.display} (generation {agreed.generation})"
    staging = _PoolStaging(rt, location, agreed.generation, options) if stage_in is None else \
        stage_in(rt, location, agreed.generation, coord.rank)
    with stats.phase("stage"):  # everything the training thread does before it gets control back
        staged = _Staged.of(coord, writes, tensors, copies, rt, staging, stepped, label)
    writer = staging.writer(staged.buffer, rt.background.abandon)
    monitor.returned()  # the caller gets control back: the blocking time ends here
    background = _BackgroundSave(staged, writer, writes.manifest_of, writes.on_report, staging, stats, monitor,
                                 commit, stats.now())
    job = rt.background.submit(background.write, background.commit, label=label)
    return SaveHandle(location.display, agreed.generation, stats, job, monitor, staged.snapshot)


@dataclass(frozen=True, slots=True)
class _RankWrites:
    """This rank's writes as planned: the pieces (those an incremental save reuses left out) and
    value records, how every rank's reports become the manifest, what completes this rank's report
    (an incremental save's reused pieces, None otherwise) and the bytes reused."""

    pieces: list[PieceWrite]
    values: list[ValueWrite]
    manifest_of: Callable[[list[RankWrites]], Manifest]
    on_report: Callable[[RankWrites], None] | None
    reused_nbytes: int


def _rank_writes(coord: Coordinator, location: Location, place: Any, rt: Runtime, agreed: AgreedPlan,
                 collected: Collected, options: SaveOptions, epoch: int) -> _RankWrites:
    """This rank's part of the agreed plan, resolved to what it writes (and, for an incremental
    save, collective: what the base stores)."""
    share, generation = agreed.share, agreed.generation
    pieces = writes_of([p.piece for p in share.pieces], agreed.plan.writes, [p.crcs for p in share.pieces])
    values = values_to_write(coord.rank, share.values, agreed.value_digests)
    manifest_of = _manifest_builder(generation, collected.framework, agreed.plan, options)
    if not options.incremental:
        return _RankWrites(pieces, values, manifest_of, None, 0)
    boxes = _base_boxes(coord, location, rt, place, agreed.base, {p.piece.name for p in share.pieces})
    reuse = decide(pieces, [p.piece for p in share.pieces], boxes, collected.frozen, generation,
                   DEFAULT_CHECKSUM_CHUNK)
    return _RankWrites(reuse.written, values, manifest_of, _Remembering(reuse, rt, place, generation, epoch),
                       reuse.reused_nbytes)


@dataclass(frozen=True, slots=True)
class _Remembering:
    """An incremental save's report hook: the reused pieces join the report, and this process
    remembers what the save stored (the next save's base)."""

    reuse: Reuse
    rt: Runtime
    place: Any
    generation: int
    epoch: int

    def __call__(self, report: RankWrites) -> None:
        self.reuse.complete(report)
        self.rt.reuse.remember(self.place, self.generation,
                               self.reuse.remembered(report, generation_dir(self.generation)), self.epoch)


@dataclass(frozen=True, slots=True)
class _Stepped:
    """What the optimizers of a state write, which an overlapped save copies while training goes on
    (they wait for the copy before they step): the optimizers, and the storages of the parameters
    they step and of their state. Whatever else the state holds is copied at the call: no hook
    makes its writers wait (a parameter no optimizer of the state steps, for one)."""

    optimizers: list[torch.optim.Optimizer]
    storages: set[tuple[torch.device, int]]

    @staticmethod
    def of(optimizers: list[Any]) -> "_Stepped":
        # By identity: an optimizer both in the state and among ``overlap_optimizers`` waits once.
        torch_optimizers = list({id(o): o for o in optimizers if isinstance(o, torch.optim.Optimizer)}.values())
        parameters = [p for o in torch_optimizers for group in o.param_groups for p in group["params"]]
        state = [t for o in torch_optimizers for values in o.state.values() for t in values.values()
                 if isinstance(t, torch.Tensor)]
        return _Stepped(torch_optimizers, {_storage_of(t) for t in parameters + state})

    def writes(self, tensor: torch.Tensor) -> bool:
        return _storage_of(tensor) in self.storages


def _storage_of(tensor: torch.Tensor) -> tuple[torch.device, int]:
    local = tensor.to_local() if is_dtensor(tensor) else tensor  # a DTensor: this rank's shard
    return local.device, local.untyped_storage().data_ptr()


@dataclass(frozen=True, slots=True)
class _Staged:
    """An asynchronous save's writes in host memory: the pieces staged in ``buffer`` (page-locked
    for ``copied_from``, the device it took copies from, if any), the values snapshot (the state
    may change once save returns), the sibling coordinator its commit runs with, and (an
    overlapped save) the copy still filling the buffer with what the optimizers write."""

    coord: Coordinator
    pieces: list[PieceWrite]
    values: list[ValueWrite]
    buffer: Any
    copied_from: torch.device | None
    snapshot: SnapshotCopy | None

    @staticmethod
    def of(coord: Coordinator, writes: _RankWrites, tensors: list[torch.Tensor], copies: ChunkedCopies,
           rt: Runtime, staging: Staging, stepped: _Stepped | None, label: str) -> "_Staged":
        background_coord = coord.sibling()  # collective: before the background thread needs it
        values = [value.snapshot() for value in writes.values]
        buffer = staging.acquire(staged_nbytes(writes.pieces))
        try:
            pieces, pairs = place(writes.pieces, buffer)
            stepped_by = [stepped is not None and stepped.writes(tensor) for _, tensor in pairs]
            copy_in([pair for pair, by_optimizer in zip(pairs, stepped_by) if not by_optimizer], copies)
            later = [pair for pair, by_optimizer in zip(pairs, stepped_by) if by_optimizer]
            snapshot = SnapshotCopy(later, copies, stepped.optimizers, label) if later else None
        except BaseException:
            staging.release(buffer)
            raise
        if snapshot is not None:
            rt.background.snapshots.add(snapshot)
        return _Staged(background_coord, pieces, values, buffer,
                       next((tensor.device for tensor in tensors if copies.holds(tensor)), None), snapshot)

    def copy_failure(self) -> CheckpointError | None:
        """Once an overlapped copy is done (waiting for it): its error, if it failed."""
        if self.snapshot is None:
            return None
        self.snapshot.wait()
        error = self.snapshot.error()
        if error is None:
            return None
        failure = CheckpointError(f"copying the parameters and optimizer state to host memory failed: {error!r}")
        failure.__cause__ = error
        return failure


@dataclass(frozen=True, slots=True)
class _BackgroundSave:
    """An asynchronous save handed to the background lane: :meth:`write` and :meth:`commit` run on
    its threads, from ``handed_over`` on. It holds the staged copies only, not the state's tensors."""

    staged: _Staged
    writer: GenerationWriter
    manifest_of: Callable[[list[RankWrites]], Manifest]
    on_report: Callable[[RankWrites], None] | None
    staging: Staging
    stats: PhaseStats
    monitor: Monitor
    commit_barrier: Commit
    handed_over: float

    def write(self) -> Outcome:
        # "queue": the wait for the lane's threads, long where an earlier save still writes or commits
        self.stats.add("queue", self.handed_over, self.stats.now())
        staged = self.staged
        try:
            failure = staged.copy_failure()  # an overlapped copy: the write starts once it is done
            if failure is not None:  # reported to every rank by the commit barrier
                return Outcome(error=failure)
            return write_share(staged.coord.rank, self.writer, staged.pieces, staged.values, self.stats,
                               monitor=self.monitor, on_report=self.on_report)
        finally:  # durable: the next save may stage into it, whatever the barrier does
            self.staging.release(staged.buffer, copied_from=staged.copied_from)

    def commit(self, report: Outcome) -> None:
        self.stats.add("queue", self.stats.spans[-1][2], self.stats.now())  # from the end of this save's write
        self.commit_barrier(self.staged.coord, self.writer, report, self.manifest_of, self.stats, self.monitor)


@dataclass(frozen=True, slots=True)
class _PoolStaging:
    """Staging in the runtime's pool of host buffers, written by the writer door (from the writer
    process where it takes the save)."""

    rt: Runtime
    location: Location
    generation: int
    options: SaveOptions

    def acquire(self, nbytes: int) -> torch.Tensor:
        return self.rt.buffers.acquire(nbytes)

    def release(self, buffer: torch.Tensor, *, copied_from: torch.device | None = None) -> None:
        self.rt.buffers.release(buffer, copied_from=copied_from)

    def writer(self, buffer: torch.Tensor, abandon: threading.Event) -> GenerationWriter:
        return GenerationWriter(self.location, self.generation, threads=self.options.io_threads, background=True,
                                abandon=abandon, in_process=_in_process(self.rt, self.location, buffer, self.options),
                                compression=self.options.compression)


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


def _collect(state: Mapping[str, Any], options: SaveOptions, path: str) -> tuple[Collected, _Stepped | None]:
    """The adapter's view of the state: pieces of the resharded components' tensors, and every other
    value encoded (and copied, so an asynchronous save is unaffected by later changes); with
    ``overlap``, what the state's optimizers write too."""
    try:
        return _collected(state, options)
    except CheckpointError as exc:
        raise exc.at(path)


def _collected(state: Mapping[str, Any], options: SaveOptions) -> tuple[Collected, _Stepped | None]:
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
    planned = [PlannedPiece(p, replica_crc=crc_of(byte_view(host_contiguous(p.tensor))) if options.verify_replicas
                            else None) for p in pieces]
    loader = state.get(DATALOADER)
    declared = tensors + [(t.name, t.tensor.dtype, tuple(t.tensor.shape)) for t in plain]
    frozen = FrozenParameters.of(bound.obj for _, parts in collected.modules for bound in parts
                                 if isinstance(bound.obj, nn.Module)) if options.incremental and options.trust_frozen \
        else None
    stepped = _Stepped.of([bound.obj for _, parts in collected.optimizers for bound in parts]
                          + list(options.overlap_optimizers)) if options.overlap else None
    return Collected(tensors, planned, values, plain, options.verify_replicas, structure_key(declared, pieces),
                     collected.framework, loader.declaration() if isinstance(loader, DataloaderState) else None,
                     frozen), stepped


def _base_boxes(coord: Coordinator, location: Location, rt: Runtime, place: Any, base: Base,
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


def _manifest_builder(generation: int, framework: str, plan: CachedPlan,
                      options: SaveOptions) -> Callable[[list[RankWrites]], Manifest]:
    def manifest_of(reports: list[RankWrites]) -> Manifest:
        manifest = assemble_manifest(generation=generation, framework=framework, checksum_chunk=DEFAULT_CHECKSUM_CHUNK,
                                     writer=f"bcp {__version__}", columns=plan.columns, reports=reports,
                                     compression=options.compression)
        manifest.step = options.step
        return manifest
    return manifest_of
