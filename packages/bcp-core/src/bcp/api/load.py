"""``bcp.load``: every rank calls it; the checkpoint is resharded into the live objects' layout.

The phases: open (one rank reads the manifest, every rank receives it), plan (the adapter names the
wanted tensors' pieces and values; names are matched against the checkpoint), read (through the
reader door; with ``read_once`` shared replicas are read by one rank and sent to the others), then
apply (values go back to the live objects)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from bcp.api.checkpoint import Checkpoint, open_checkpoint
from bcp.api.components import SKIP, StateValues, check_keys, collect
from bcp.api.gc_pause import paused_gc
from bcp.api.metrics import Monitor
from bcp.api.names import NameMatch, listing, match_names, unexpected_across_ranks
from bcp.api.options import LoadOptions
from bcp.api.per_rank import warn_world_change, world_change
from bcp.api.results import LoadResult, PhaseStats
from bcp.api.runtime import runtime
from bcp.coord import Coordinator, as_coordinator
from bcp.coord.consensus import Outcome, all_agree, gather_then_reply
from bcp.engine.load_staging import Staging
from bcp.errors import CheckpointError, MismatchError
from bcp.layout.piece import Piece
from bcp.layout.read_op import ReadOp, ReadRequest, ReadRole
from bcp.layout.shards import is_tensor_value
from bcp.planning.load_plan import staged
from bcp.planning.pieces import pieces_of, tensor_meta
from bcp.planning.read_once import assign_readers
from bcp.storage import Storage

@paused_gc()  # a load of thousands of tensors builds a few records per tensor, none in cycles
def load(path: "str | os.PathLike | Storage", state: dict[str, Any], options: LoadOptions | None = None,
         **keywords: Any) -> LoadResult:
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
    ``framework``, ``role``, ``coordinator``, ``allow_pickle``, ``io_threads``.
    """
    options = (options or LoadOptions()).merged(keywords)
    check_keys(state)
    coord = as_coordinator(options.coordinator)
    stats = PhaseStats()
    monitor = Monitor("load", coord.rank, coord.world_size, stats, options.topology, options.metrics_log,
                      options.summary_log_level)
    try:
        return _load(path, state, options, coord, monitor)
    except BaseException as exc:
        monitor.fail(None, exc)
        raise


def _load(path: "str | os.PathLike | Storage", state: dict[str, Any], options: LoadOptions, coord: Coordinator,
          monitor: Monitor) -> LoadResult:
    stats = monitor.stats
    monitor.begin(path)
    with stats.phase("metadata"):
        checkpoint = open_checkpoint(path, role=options.role, generation=options.generation, verify=options.verify,
                                     io_threads=options.io_threads, coordinator=coord)
    monitor.location, monitor.generation = checkpoint.location, checkpoint.generation
    manifest = checkpoint.manifest
    result = LoadResult(checkpoint.path, checkpoint.generation, manifest.world_size, manifest.framework,
                        stats=stats)
    with stats.phase("plan"):
        planned = Outcome.of(lambda: _plan(state, checkpoint, result, options))
    if isinstance(planned.error, CheckpointError):
        planned.error.at(checkpoint.path)
    roles = _read_once_roles(coord, planned, checkpoint) if options.read_once else None
    read = Outcome.of(lambda: _read(planned, checkpoint, roles, coord, result, options.allow_pickle))
    stats.bytes = checkpoint.bytes_read
    _agree_on_reading(coord, planned, read, checkpoint, result, options.strict)
    with stats.phase("apply"):
        applied = Outcome.of(lambda: _apply(planned.value, read.value))
    if planned.error is None:  # the staging buffers serve the next load, whatever happened to this one
        planned.value.staging.release()
    # every rank's metrics record travels on the final agreement: monitoring adds no exchange
    every_rank = all_agree(coord, Outcome(monitor.rank_wire(), applied.error),
                           f"restoring the state loaded from {checkpoint.path}")
    if coord.rank == 0:
        monitor.finish(every_rank)
        result.metrics = monitor.record
    return result


@dataclass(slots=True)
class _Plan:
    """What the live state wants: its values by name, the reads that fill its tensors, and the names
    of the values to decode."""

    state: StateValues
    wanted: dict[str, Any]
    names: NameMatch
    ops: list[ReadOp] = field(default_factory=list)
    values: list[str] = field(default_factory=list)
    #: (live piece, staging tensor) pairs of a transactional or cast load: the reads fill the staging tensors.
    staged: list[tuple[Piece, torch.Tensor]] = field(default_factory=list)
    staging: Staging = field(default_factory=lambda: Staging(runtime().load_staging))


def _plan(state: dict[str, Any], checkpoint: Checkpoint, result: LoadResult, options: LoadOptions) -> _Plan:
    manifest = checkpoint.manifest
    live = collect(state, options.framework, for_load=True, saved_tensors=checkpoint.tensors,
                   saved_objects=checkpoint.objects, path=result.path)
    plan = _Plan(live, live.values, match_names(live.values, checkpoint, options.strict))
    result.loaded, result.missing = plan.names.loaded, plan.names.missing
    pieces: list[Piece] = []
    for name in result.loaded:
        if name in manifest.tensors and is_tensor_value(plan.wanted[name]):
            checkpoint.check_meta(name, *tensor_meta(name, plan.wanted[name]), cast_dtype=options.cast_dtype)
            pieces.extend(pieces_of(name, plan.wanted[name]))
        elif name in manifest.objects:
            if plan.wanted[name] is not SKIP:
                plan.values.append(name)
        else:
            raise MismatchError("saved as a tensor but the live value is not one, or the reverse",
                                path=result.path, key=name)
    pieces, plan.staged = staged(manifest, pieces, every=options.transactional, allocate=plan.staging.allocate)
    plan.ops = checkpoint.plan(pieces)
    return plan


def _read_once_roles(coord: Coordinator, planned: Outcome, checkpoint: Checkpoint) -> list[ReadRole] | None:
    """Who reads each shared region (collective); None where the coordinator cannot move tensors."""
    if coord.world_size == 1 or coord.process_group() is None:
        return None
    wire = [ReadRequest.of(op).to_wire() for op in planned.value.ops] if planned.error is None else None
    roles = gather_then_reply(coord, Outcome(wire, planned.error), _assign_readers,
                              f"planning the load of {checkpoint.path}")
    return [ReadRole.from_wire(role) for role in roles]


def _assign_readers(every_rank: list[list[list[Any]]]) -> list[list[list[Any]]]:
    requests = [[ReadRequest.from_wire(request) for request in rows] for rows in every_rank]
    return [[role.to_wire() for role in roles] for roles in assign_readers(requests)]


def _read(planned: Outcome, checkpoint: Checkpoint, roles: list[ReadRole] | None, coord: Coordinator,
          result: LoadResult, allow_pickle: bool) -> dict[str, Any]:
    if planned.error is not None:
        raise planned.error
    plan: _Plan = planned.value
    with result.stats.phase("read"):
        if roles is None:
            checkpoint.run_reads(plan.ops)
        else:
            result.stats.received_bytes = checkpoint.run_reads_shared(plan.ops, roles, coord.process_group())
        loaded = {name: plan.wanted[name] for name in result.loaded if name in checkpoint.tensors}
        sources: dict[str, int] = {}
        for name in plan.values:
            if name in plan.state.merged:
                merged = checkpoint.distinct_values(name, allow_pickle=allow_pickle)
                loaded[name] = [item for value in merged for item in value]
                continue
            sources[name] = source = checkpoint.value_source(name, coord.rank)
            if source != coord.rank and name in plan.state.per_rank:
                result.from_rank0.append(name)
        loaded.update(checkpoint.read_objects(sources, allow_pickle=allow_pickle))
    result.duplicated, result.dropped = world_change(
        checkpoint.objects, [name for name in plan.values if name in plan.state.per_rank], coord.world_size)
    if coord.rank == 0:
        warn_world_change(checkpoint.path, checkpoint.manifest.world_size, coord.world_size, result.duplicated,
                          result.dropped)
    return loaded


def _agree_on_reading(coord: Coordinator, planned: Outcome, read: Outcome, checkpoint: Checkpoint,
                      result: LoadResult, strict: bool) -> None:
    """Collective: every rank read and verified its share, and every saved name of a requested
    component is wanted by some rank (asked only when a rank has names left over)."""
    left_over = Outcome(bool(planned.value.names.left_over) if read.error is None else None, read.error)
    if any(all_agree(coord, left_over, f"loading {checkpoint.path}")):
        result.unexpected = unexpected_across_ranks(coord, Outcome.of(lambda: planned.value.names), checkpoint)
        if strict and result.unexpected:
            raise MismatchError(f"strict load: in the checkpoint but wanted by no rank: {listing(result.unexpected)} "
                                "(pass strict=False to load the overlap)", path=checkpoint.path)


def _apply(plan: _Plan, loaded: dict[str, Any]) -> None:
    """Every rank has read and verified everything: place staged bytes into the live tensors, then
    give the values back to the live objects."""
    plan.staging.place([(piece.tensor, staging) for piece, staging in plan.staged])
    plan.state.apply(loaded)
