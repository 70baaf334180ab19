"""``bcp.load``: every rank calls it; the checkpoint is resharded into the live objects' layout.

Two halves. What the live state wants (``_StateWanted``: the adapters name the wanted tensors'
pieces and values; names are matched against the checkpoint), and :func:`load_wanted`, which any
integration with wanted pieces and values of its own calls too: open (one rank reads the manifest,
every rank receives it), plan (the wanted pieces become reads, into staging tensors for a
transactional load), read (through the reader door; with ``read_once`` shared replicas are read by
one rank and sent to the others), agree (every rank read and verified its share), then apply (staged
bytes are placed and values go back to the live objects)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from bcp.api.checkpoint import Checkpoint, open_checkpoint
from bcp.api.components import PLACED, SKIP, StateValues, check_keys, collect
from bcp.api.gc_pause import paused_gc
from bcp.api.metrics import Monitor
from bcp.api.names import NameMatch, match_names, unexpected_error, unloaded_across_ranks
from bcp.api.options import LoadOptions
from bcp.api.per_rank import warn_world_change, world_change
from bcp.api.results import LoadResult, PhaseStats
from bcp.api.runtime import runtime
from bcp.api.targets import CheckpointTarget
from bcp.api.undo import Undo
from bcp.coord import Coordinator, as_coordinator
from bcp.coord.consensus import Outcome, all_agree, gather_then_reply
from bcp.engine.chunked_copies import ChunkedCopies
from bcp.engine.load_staging import Staging
from bcp.errors import CheckpointError, CorruptCheckpointError, MismatchError
from bcp.layout.piece import Piece
from bcp.layout.read_op import ReadOp, ReadRequest, ReadRole
from bcp.layout.shards import is_tensor_value
from bcp.planning.load_plan import staged
from bcp.planning.pieces import pieces_of, tensor_meta
from bcp.planning.read_once import assign_readers
from bcp.storage import Storage

def load(path: "str | os.PathLike | Storage | CheckpointTarget", state: dict[str, Any],
         options: LoadOptions | None = None, **keywords: Any) -> LoadResult:
    """Load the newest committed checkpoint at ``path`` (or the kept ``generation``) into ``state``
    (in place).

    Model and optimizer are resharded into the layout they have now. ``options``
    (:class:`LoadOptions`), or its fields as keywords: with ``strict``, every requested entry must be
    saved and every saved entry of a requested component requested by some rank (a pipeline stage
    asks for its own names only); ``verify`` checks every byte
    read against its checksum; with ``read_once``, bytes that several ranks need (data-parallel
    replicas) are read from storage by one of them and sent to the others over the process group;
    ``transactional`` (default) leaves the live state untouched when the load fails; with
    ``cast_dtype``, a tensor saved in another dtype than the live one is converted instead of refused;
    ``generation`` loads an older kept generation;
    ``framework``, ``role``, ``coordinator``, ``allow_pickle``, ``io_threads``. ``path`` may also be
    a :class:`bcp.MemoryTier`: the result's ``source`` and ``source_reason`` say which tier was read.
    """
    options = (options or LoadOptions()).merged(keywords)
    check_keys(state)
    runtime().background.snapshots.wait()  # an overlapped save's copy may still read what this load writes
    return load_wanted(path, lambda checkpoint, result: _StateWanted.of(state, checkpoint, result, options),
                       options)


class Wanted(Protocol):
    """What a live state wants from a checkpoint: the pieces of saved tensors to fill (their live
    tensors are written only once every rank has read and verified its share), the values to read,
    and how those go back to the live objects."""

    #: The tensor pieces to fill, checked against the saved dtypes and shapes.
    pieces: list[Piece]

    def left_over(self) -> NameMatch | None:
        """The names matched against the checkpoint, for the strict check that every saved name of a
        requested component is wanted by some rank; None where the caller checks that itself."""

    def read_values(self, checkpoint: Checkpoint, coord: Coordinator, result: LoadResult) -> dict[str, Any]:
        """Read the wanted values (the tensor pieces are read by then), by name."""

    def apply(self, loaded: dict[str, Any]) -> None:
        """Give the values read back to the live objects (the tensor pieces are placed by then).
        Where the load fails, the placed bytes are taken back; what ``apply`` changed beyond them
        is taken back only by a wanted that is also :class:`UndoableWanted`."""


@runtime_checkable
class UndoableWanted(Protocol):
    """A :class:`Wanted` whose apply records how to take back what it changed (a load that fails
    on any rank, in its apply or after it, then leaves the live objects as they were)."""

    def apply_undoable(self, loaded: dict[str, Any], undo: Undo) -> None:
        """:meth:`Wanted.apply`, recording in ``undo`` how to take each change back."""


#: Names what a live state wants, once the checkpoint is open (raises a CheckpointError when it cannot).
Want = Callable[[Checkpoint, LoadResult], Wanted]


class ReadSource(Protocol):
    """Where a load reads from when that is not one checkpoint path (a memory tier's node-local
    copies): how the checkpoint is opened, and what is fetched before this rank's reads run."""

    #: The source as the metrics record names it (a path, URL, Storage or words).
    display: Any

    def open(self, coord: Coordinator, options: LoadOptions) -> Checkpoint:
        """Collective: the checkpoint every rank reads from (the same manifest on every rank)."""

    def gather(self, coord: Coordinator, checkpoint: Checkpoint, ops: list[ReadOp] | None) -> None:
        """Collective: make every byte ``ops`` (this rank's planned reads; None where planning
        failed) and the value records readable through ``checkpoint`` on this rank."""


@paused_gc()  # a load of thousands of tensors builds a few records per tensor, none in cycles
def load_wanted(path: "str | os.PathLike | Storage | CheckpointTarget", want: Want,
                options: LoadOptions) -> LoadResult:
    """Collective: open the checkpoint at ``path``, read the pieces and values ``want`` names,
    verify them, agree across ranks that every rank has, then apply; with ``options.transactional``
    no live tensor is written unless every rank read everything. Writes the load's metrics record.
    ``path`` may be a :class:`bcp.MemoryTier`, which chooses where to read from."""
    if isinstance(path, CheckpointTarget):
        return path.load_wanted(want, options)
    return load_from(_PathSource(path), want, options)


def load_from(source: ReadSource, want: Want, options: LoadOptions) -> LoadResult:
    """Collective: :func:`load_wanted` from ``source``."""
    coord = as_coordinator(options.coordinator)
    stats = PhaseStats()
    monitor = Monitor("load", coord.rank, coord.world_size, stats, options.topology, options.metrics_log,
                      options.summary_log_level)
    try:
        return _load(source, want, options, coord, monitor)
    except BaseException as exc:
        monitor.fail(None, exc)
        raise


@dataclass(frozen=True, slots=True)
class _PathSource:
    """A checkpoint path: rank 0 reads the manifest, every rank reads its share from storage."""

    path: "str | os.PathLike | Storage"

    @property
    def display(self) -> Any:
        return self.path

    def open(self, coord: Coordinator, options: LoadOptions) -> Checkpoint:
        return open_checkpoint(self.path, role=options.role, generation=options.generation, verify=options.verify,
                               io_threads=options.io_threads, coordinator=coord)

    def gather(self, coord: Coordinator, checkpoint: Checkpoint, ops: list[ReadOp] | None) -> None:
        return None


def _load(source: ReadSource, want: Want, options: LoadOptions, coord: Coordinator,
          monitor: Monitor) -> LoadResult:
    stats = monitor.stats
    monitor.begin(source.display)
    runtime().reuse.forget()  # the load writes live tensors without moving their version counters
    with stats.phase("metadata"):
        checkpoint = source.open(coord, options)
    monitor.location, monitor.generation = checkpoint.location, checkpoint.generation
    manifest = checkpoint.manifest
    result = LoadResult(checkpoint.path, checkpoint.generation, manifest.world_size, manifest.framework,
                        stats=stats)
    with stats.phase("plan"):
        planned = Outcome.of(lambda: _plan(want, checkpoint, result, options))
        if isinstance(planned.error, CheckpointError):
            planned.error.at(checkpoint.path)
        roles = None
        if options.read_once:
            with stats.phase("plan.readers"):
                roles = _read_once_roles(coord, planned, checkpoint)
    with stats.phase("read"):
        ops = planned.value.ops if planned.error is None else None  # gathering is collective: every rank takes part
        gathered = Outcome.of(lambda: source.gather(coord, checkpoint, ops))
        read = _once_succeeded([gathered, planned], lambda: _read(planned.value, checkpoint, roles, coord, result))
    stats.bytes, stats.value_bytes = checkpoint.bytes_read, checkpoint.value_bytes_read
    if read.error is not None:  # raised by the agreement, where it surfaces on every rank
        stats.failed_phase = "plan" if planned.error is not None else "read"
    with stats.phase("agree"):
        _agree_on_reading(coord, planned, read, checkpoint, result, options.strict)
    undo = Undo()
    with stats.phase("apply"):
        applied = Outcome.of(lambda: _apply(planned.value, read.value, undo, checkpoint.path))
    # every rank's metrics record travels on the final agreement, so monitoring adds no exchange;
    # the coordinating rank's own record, completed after it, also holds its wait there
    with stats.phase("confirm"):
        try:
            every_rank = all_agree(coord, Outcome(monitor.rank_wire(), applied.error),
                                   f"restoring the state loaded from {checkpoint.path}")
        except BaseException as exc:  # this rank's apply or another's failed (or a peer died)
            # every rank takes its changes back here, after the agreement and not before it, so an
            # undo step that talks to the other ranks (a user's Stateful) meets them all there
            undo.run(exc)
            raise
        finally:  # the staging buffers serve the next load, whatever happened to this one
            if planned.error is None:
                planned.value.staging.release()
    if coord.rank == 0:
        monitor.finish(every_rank)
        result.metrics = monitor.record
    return result


@dataclass(slots=True)
class _Plan:
    """What a load reads: the live state's wants, the reads that fill its tensors' pieces."""

    wanted: Wanted
    ops: list[ReadOp] = field(default_factory=list)
    #: (live piece, staging tensor) pairs of a transactional or cast load, or of pieces in accelerator
    #: memory: the reads fill the staging tensors.
    staged: list[tuple[Piece, torch.Tensor]] = field(default_factory=list)
    staging: Staging = field(default_factory=lambda: Staging(runtime().load_staging, ChunkedCopies(runtime().chunks)))
    #: Whether staged pieces are placed as soon as they are read (a load that is not transactional).
    place_as_read: bool = False


def _plan(want: Want, checkpoint: Checkpoint, result: LoadResult, options: LoadOptions) -> _Plan:
    """The plan, in parts: what the live state wants (its names matched against the checkpoint's),
    the staging tensors of a transactional load or of pieces in accelerator memory, the reads."""
    with result.stats.phase("plan.state"):
        plan = _Plan(want(checkpoint, result), place_as_read=not options.transactional)
    with result.stats.phase("plan.staging"):
        pieces, plan.staged = staged(checkpoint.manifest, plan.wanted.pieces, every=options.transactional,
                                     allocate=plan.staging.allocate, in_host_memory=plan.staging.in_host_memory)
    with result.stats.phase("plan.reads"):
        plan.ops = checkpoint.plan(pieces)
    return plan


@dataclass(slots=True)
class _StateWanted:
    """What a ``bcp.load`` state wants: its values by name, the pieces of its tensors, and the names
    of the values to decode."""

    state: StateValues
    wanted: dict[str, Any]
    names: NameMatch
    allow_pickle: bool
    cast_dtype: bool
    pieces: list[Piece] = field(default_factory=list)
    values: list[str] = field(default_factory=list)

    @staticmethod
    def of(state: dict[str, Any], checkpoint: Checkpoint, result: LoadResult, options: LoadOptions) -> "_StateWanted":
        manifest = checkpoint.manifest
        live = collect(state, options.framework, for_load=True, saved_tensors=checkpoint.tensors,
                       saved_objects=checkpoint.objects, path=result.path)
        plan = _StateWanted(live, live.values, match_names(live.values, checkpoint, options.strict),
                            options.allow_pickle, options.cast_dtype)
        result.loaded, result.missing = plan.names.loaded, plan.names.missing
        for name in result.loaded:
            wanted = plan.wanted[name]
            if name in manifest.tensors and is_tensor_value(wanted):
                checkpoint.check_meta(name, *tensor_meta(name, wanted), cast_dtype=options.cast_dtype)
                plan.pieces.extend(pieces_of(name, wanted))
            elif name in manifest.tensors and (wanted is PLACED or name in live.per_rank):
                plan.wanted[name] = placed = checkpoint.empty_tensor(name)  # nothing live to load into
                plan.pieces.extend(pieces_of(name, placed))
            elif name in manifest.objects:
                if wanted is not SKIP:
                    plan.values.append(name)
            else:
                raise MismatchError("saved as a tensor but the live value is not one, or the reverse",
                                    path=result.path, key=name)
        return plan

    def left_over(self) -> NameMatch:
        return self.names

    def read_values(self, checkpoint: Checkpoint, coord: Coordinator, result: LoadResult) -> dict[str, Any]:
        loaded = {name: self.wanted[name] for name in result.loaded if name in checkpoint.tensors}
        held = {name for names in self.state.held.values() for name in names}
        own = self.state.per_rank | self.state.plain | held  # each rank's own where saved per rank
        sources: dict[str, int] = {}
        for name in self.values:
            if name in self.state.merged:
                merged = checkpoint.distinct_values(name, allow_pickle=self.allow_pickle)
                loaded[name] = [item for value in merged for item in value]
                continue
            sources[name] = source = checkpoint.value_source(name, coord.rank)
            if source != coord.rank and name in own:
                result.from_rank0.append(name)
        # the per-rank tensors that values hold first: the values' references resolve to them
        loaded.update(checkpoint.read_objects({n: r for n, r in sources.items() if n in held},
                                              allow_pickle=self.allow_pickle))
        loaded.update(checkpoint.read_objects({n: r for n, r in sources.items() if n not in held},
                                              allow_pickle=self.allow_pickle, resolve=_resolver(loaded, checkpoint)))
        for name in sources.keys() & (self.state.plain | held):
            self._check_in_place(name, loaded, checkpoint.path)
        result.duplicated, result.dropped = world_change(
            checkpoint.objects, [name for name in self.values if name in own], coord.world_size)
        if coord.rank == 0:
            warn_world_change(checkpoint.path, checkpoint.manifest.world_size, coord.world_size, result.duplicated,
                              result.dropped)
        self.state.check(loaded, checkpoint.path)  # before the agreement: a refusal fails every rank unchanged
        return loaded

    def _check_in_place(self, name: str, loaded: dict[str, Any], path: str) -> None:
        """A tensor saved per rank goes into its live tensor as a module's does: same shape, and the
        same dtype unless the load casts (it is then converted here, before anything is placed)."""
        live, value = self.wanted[name], loaded[name]
        if not isinstance(live, torch.Tensor) or not isinstance(value, torch.Tensor):
            return  # nothing live to load into, or a value saved there: placed
        if tuple(value.shape) != tuple(live.shape) or (value.dtype != live.dtype and not self.cast_dtype):
            raise MismatchError(f"saved as {str(value.dtype).removeprefix('torch.')} {list(value.shape)}, the live "
                                f"tensor is {str(live.dtype).removeprefix('torch.')} {list(live.shape)}"
                                f"{'' if value.shape != live.shape else ' (pass cast_dtype=True to convert)'}",
                                path=path, key=name)
        loaded[name] = value.to(live.dtype)

    def apply(self, loaded: dict[str, Any]) -> None:
        self.apply_undoable(loaded, Undo())

    def apply_undoable(self, loaded: dict[str, Any], undo: Undo) -> None:
        self.state.apply(loaded, undo)


def _resolver(loaded: dict[str, Any], checkpoint: Checkpoint) -> Callable[[str], Any]:
    """A value's references, resolved to the tensors this load read for them."""
    def resolve(name: str) -> Any:
        if name not in loaded:
            raise CorruptCheckpointError(f"a value refers to the tensor {name!r}, which the checkpoint does not hold",
                                         path=checkpoint.path, key=name)
        return loaded[name]
    return resolve


def _read_once_roles(coord: Coordinator, planned: Outcome, checkpoint: Checkpoint) -> list[ReadRole] | None:
    """Who reads each shared region (collective); None where the coordinator cannot move tensors."""
    if coord.world_size == 1 or coord.process_group() is None:
        return None
    wire = ReadRequest.list_to_wire([ReadRequest.of(op) for op in planned.value.ops]) if planned.error is None \
        else None
    roles = gather_then_reply(coord, Outcome(wire, planned.error), _assign_readers,
                              f"planning the load of {checkpoint.path}")
    return ReadRole.list_from_wire(roles)


def _assign_readers(every_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    requests = [ReadRequest.list_from_wire(rows) for rows in every_rank]
    return [ReadRole.list_to_wire(roles) for roles in assign_readers(requests)]


def _once_succeeded(earlier: list[Outcome], phase: Callable[[], Any]) -> Outcome:
    """The outcome of ``phase()`` where every earlier phase succeeded; else the first earlier failure,
    carried on (the agreement raises it on every rank)."""
    failed = next((outcome for outcome in earlier if outcome.error is not None), None)
    return failed if failed is not None else Outcome.of(phase)


def _read(plan: _Plan, checkpoint: Checkpoint, roles: list[ReadRole] | None, coord: Coordinator,
          result: LoadResult) -> dict[str, Any]:
    if roles is None:
        pairs = [(piece.tensor, staging) for piece, staging in plan.staged] if plan.place_as_read else []
        checkpoint.run_reads(plan.ops, on_done=plan.staging.place_as_read(pairs, plan.ops))
    else:
        result.stats.received_bytes = checkpoint.run_reads_shared(plan.ops, roles, coord.process_group())
    return plan.wanted.read_values(checkpoint, coord, result)


def _agree_on_reading(coord: Coordinator, planned: Outcome, read: Outcome, checkpoint: Checkpoint,
                      result: LoadResult, strict: bool) -> None:
    """Collective: every rank read and verified its share; the saved names no rank loads are the
    result's ``unexpected``, and ``strict`` refuses those of a component some rank asked for."""
    match = _once_succeeded([read], lambda: planned.value.wanted.left_over())
    unloaded = unloaded_across_ranks(coord, match, checkpoint)
    result.unexpected = unloaded.every
    if strict and unloaded.in_requested:
        raise unexpected_error(unloaded.in_requested, checkpoint)


def _apply(plan: _Plan, loaded: dict[str, Any], undo: Undo, path: str) -> None:
    """Every rank has read and verified everything: place staged bytes into the live tensors, then
    give the values back to the live objects, recording in ``undo`` how to take each change back
    (a load that is not transactional may have placed bytes as they were read: those stay)."""
    undo.on_contents(plan.staging.unplace)  # before placing: a place that fails part way is taken back too
    plan.staging.place([(piece.tensor, staging) for piece, staging in plan.staged], undoable=not plan.place_as_read)
    try:
        if isinstance(plan.wanted, UndoableWanted):
            plan.wanted.apply_undoable(loaded, undo)
        else:
            plan.wanted.apply(loaded)
    except CheckpointError as exc:
        raise exc.at(path)
