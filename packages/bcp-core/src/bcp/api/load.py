"""``bcp.load``: every rank calls it; the checkpoint is resharded into the live objects' layout."""

from __future__ import annotations

import os
from typing import Any

from bcp.adapters import adapter_for
from bcp.api.components import RESHARDED, apply, check_keys, collect
from bcp.api.gc_pause import paused_gc
from bcp.api.location import resolve
from bcp.api.results import LoadResult, PhaseStats
from bcp.api.save import DEFAULT_IO_THREADS
from bcp.coord import Coordinator, default_coordinator
from bcp.coord.consensus import Outcome, all_agree, broadcast_from_root, gather_then_reply
from bcp.engine.location import Location
from bcp.engine.reader import ShardReader
from bcp.engine.redistribute import read_and_share
from bcp.errors import MismatchError
from bcp.layout.manifest import Manifest, ObjectEntry
from bcp.layout.shards import is_tensor_value
from bcp.planning.load_plan import ReadOp, check_meta, plan_reads
from bcp.planning.pieces import pieces_of, tensor_meta
from bcp.planning.read_once import assign_readers, read_requests
from bcp.storage import Storage

_LISTED = 20  # names shown in a strict-mode error before "and N more"


@paused_gc()  # a load of thousands of tensors builds a few records per tensor, none in cycles
def load(
    path: "str | os.PathLike | Storage",
    state: dict[str, Any],
    *,
    framework: str | None = None,
    strict: bool = True,
    role: str | None = None,
    coordinator: Coordinator | None = None,
    allow_pickle: bool = False,
    verify: bool = True,
    io_threads: int = DEFAULT_IO_THREADS,
    read_once: bool = False,
) -> LoadResult:
    """Load the newest committed checkpoint at ``path`` into ``state`` (in place).

    Model and optimizer are resharded into the layout they have now. With ``strict``, every
    requested entry must be saved and every saved entry of a requested component requested.
    ``verify`` checks every byte read against its checksum. With ``read_once``, bytes that several
    ranks need (data-parallel replicas) are read from storage by one of them and sent to the others
    over the process group.
    """
    check_keys(state)
    coord = coordinator or default_coordinator()
    location = resolve(path, role)
    stats = PhaseStats()

    with stats.phase("metadata"):
        found = Outcome.of(lambda: _read_manifest(location)) if coord.rank == 0 else Outcome()
        generation, data, table = broadcast_from_root(coord, found, f"opening {location.display}")
        manifest = Manifest.decode(data, table, path=location.display)

    result = LoadResult(location.display, generation, manifest.world_size, manifest.framework, stats=stats)
    adapter = adapter_for(state, framework) if any(k in state for k in RESHARDED) else None
    reader = ShardReader(location, generation, manifest, verify=verify)
    planned = Outcome.of(lambda: _plan(state, adapter, manifest, result, strict))
    roles = None
    if read_once and coord.world_size > 1:
        requests = Outcome(read_requests(planned.value[1]) if planned.error is None else None, planned.error)
        roles = gather_then_reply(coord, requests, assign_readers, f"planning the load of {location.display}")
    read = Outcome.of(lambda: _read(planned, reader, roles, coord, result, allow_pickle, io_threads))
    stats.bytes = reader.bytes_read
    all_agree(coord, Outcome(error=read.error), f"loading {location.display}")
    with stats.phase("apply"):
        applied = Outcome.of(lambda: apply(state, adapter, read.value))
        all_agree(coord, applied, f"restoring the state loaded from {location.display}")
    return result


def _read_manifest(location: Location) -> list[Any]:
    generation = location.latest_committed()
    return [generation, *location.read_manifest_files(generation)]


def _plan(state: dict[str, Any], adapter: Any, manifest: Manifest, result: LoadResult,
          strict: bool) -> tuple[dict[str, Any], list[ReadOp], list[str]]:
    """What the live state wants: its values by name, the reads that fill its tensors, and the
    names of the values to decode."""
    with result.stats.phase("plan"):
        wanted = collect(state, adapter, for_load=True)
        _match_names(wanted, manifest, strict, result)
        pieces, objects = [], []
        for name in result.loaded:
            if name in manifest.tensors and is_tensor_value(wanted[name]):
                check_meta(manifest, name, *tensor_meta(name, wanted[name]), result.path)
                pieces.extend(pieces_of(name, wanted[name]))
            elif name in manifest.objects:
                objects.append(name)
            else:
                raise MismatchError("saved as a tensor but the live value is not one, or the reverse",
                                    path=result.path, key=name)
        return wanted, plan_reads(manifest, pieces, result.path), objects


def _read(planned: Outcome, reader: ShardReader, roles: list[Any] | None, coord: Coordinator,
          result: LoadResult, allow_pickle: bool, io_threads: int) -> dict[str, Any]:
    if planned.error is not None:
        raise planned.error
    wanted, ops, objects = planned.value
    manifest, rank = reader.manifest, coord.rank
    with result.stats.phase("read"):
        if roles is None:
            reader.run(ops, io_threads)
        else:
            result.stats.received_bytes = read_and_share(reader, ops, roles, coord.group, io_threads)
        loaded = {name: wanted[name] for name in result.loaded if name in manifest.tensors}
        for name in objects:
            entry = manifest.objects[name]
            source = _source_rank(entry, rank)
            if source != rank and name.split("/", 1)[0] not in RESHARDED:
                result.from_rank0.append(name)
            loaded[name] = reader.read_object(entry, source, allow_pickle=allow_pickle)
    return loaded


def _source_rank(entry: ObjectEntry, rank: int) -> int:
    """Whose saved value a rank receives: its own, else rank 0's, else the first rank's that saved one."""
    if rank < len(entry.ranks) and entry.ranks[rank] >= 0:
        return rank
    return next(r for r, record in enumerate(entry.ranks) if record >= 0)


def _match_names(wanted: dict[str, Any], manifest: Manifest, strict: bool, result: LoadResult) -> None:
    components = {name.split("/", 1)[0] for name in wanted}
    saved = {n for n in [*manifest.tensors, *manifest.objects] if n.split("/", 1)[0] in components}
    missing = sorted(set(wanted) - saved)
    unexpected = sorted(saved - set(wanted))
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_listing(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the live state: {_listing(unexpected)}")
        raise MismatchError("strict load: " + "; ".join(parts) + " (pass strict=False to load the overlap)",
                            path=result.path)
    result.missing, result.unexpected = missing, unexpected
    result.loaded = [name for name in wanted if name in saved]


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")
