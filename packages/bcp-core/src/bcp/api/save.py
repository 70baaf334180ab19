"""``bcp.save``: every rank calls it; the checkpoint is committed when it returns (or, for an
asynchronous save, when the handle's ``wait()`` returns)."""

from __future__ import annotations

import os
from typing import Any, Mapping

from bcp.version import __version__
from bcp.adapters import adapter_for
from bcp.api.components import RESHARDED, check_keys, collect
from bcp.api.location import resolve
from bcp.api.results import PhaseStats, SaveHandle
from bcp.coord import Coordinator, default_coordinator
from bcp.coord.consensus import Outcome, gather_then_reply
from bcp.engine.bytes_of import byte_view, host_contiguous
from bcp.engine.checksum import crc_of
from bcp.engine.commit import build_manifest
from bcp.engine.writer import write_rank
from bcp.errors import CheckpointError
from bcp.layout.manifest import DEFAULT_CHECKSUM_CHUNK
from bcp.layout.values import EncodedValue, encode_value
from bcp.planning.pieces import Piece, is_tensor_value, pieces_of, tensor_meta
from bcp.planning.save_plan import LocalObject, global_plan, local_plan
from bcp.storage import Storage

DEFAULT_IO_THREADS = 4


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
    ``allow_pickle`` lets values outside the safe encoding be pickled (the checkpoint is then
    marked unsafe); ``verify_replicas`` checks, by checksum, that replicated tensors agree.
    """
    if async_save:
        raise CheckpointError("async_save is not available yet in this build")
    check_keys(state)
    coord = coordinator or default_coordinator()
    location = resolve(path, role)
    stats = PhaseStats()
    adapter = adapter_for(state, framework) if any(k in state for k in RESHARDED) else None

    with stats.phase("plan"):
        prepared = Outcome.of(lambda: _prepare(state, adapter, allow_pickle, verify_replicas))
        pieces, objects, plan = prepared.value if prepared.error is None else ([], [], None)
        prepared.value = plan
        kept: dict[str, Any] = {}

        def plan_globally(plans: list[Any]) -> list[Any]:
            replies, kept["owners"] = global_plan(plans)
            kept["plans"] = plans
            generation = location.next_generation()
            return [[generation, *reply] for reply in replies]

        generation, piece_indices, object_names = gather_then_reply(
            coord, prepared, plan_globally, f"planning the save of {location.display}")

    with stats.phase("write"):
        by_name = dict(objects)
        written = Outcome.of(lambda: write_rank(
            location, generation, coord.rank, [(i, pieces[i]) for i in piece_indices],
            [(n, by_name[n]) for n in object_names], io_threads, DEFAULT_CHECKSUM_CHUNK).to_wire())
    stats.bytes = sum(row[3] for row in written.value[1] + written.value[2]) if written.error is None else 0

    with stats.phase("commit"):
        def commit(writes: list[Any]) -> list[Any]:
            manifest = build_manifest(
                generation=generation, framework=adapter.name if adapter else "none",
                checksum_chunk=DEFAULT_CHECKSUM_CHUNK,
                unsafe_pickle=any(plan[3] for plan in kept["plans"]),
                writer=f"bcp {__version__}", local_plans=kept["plans"], writes=writes,
                object_owners=kept["owners"])
            location.commit(generation, manifest.to_json())
            location.remove_older_than(generation)
            return [None] * coord.world_size

        gather_then_reply(coord, written, commit, f"writing the checkpoint {location.display}")
    return SaveHandle(location.display, generation, stats)


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
    described = [LocalObject(n, crc_of(memoryview(b"".join(v.chunks()))), v.nbytes) for n, v in objects]
    crcs = [crc_of(byte_view(host_contiguous(p.tensor))) for p in pieces] if verify_replicas else None
    return pieces, objects, local_plan(tensors, pieces, described, crcs, any(v.used_pickle for _, v in objects))
