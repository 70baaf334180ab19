"""Cases on 2 processes (gloo, CPU): DTensor Shard(0) saves and loads (same layout, resharded to
Shard(1)), Shard(0) saves loaded by 1 process, Shard(1) saves loaded as Shard(0), DP-replicated saves
and loads, then the FSDP1 save (``fsdp1``).

A process's load staging buffers serve its next load whose buffers have the same sizes (bcp keeps
the last load's set; a rank's Shard(0) and Shard(1) pieces fill flat buffers of one size). The 2 -> 1
load, whose buffers are twice that size, therefore has rounds of its own: in shared rounds every
repetition of it, and the next Shard(0) load, would allocate and page-fault fresh staging memory,
where a process that repeats a load reuses its buffers as the anchors reuse their memory."""

from __future__ import annotations

import gc
import itertools
import math
from typing import Any

import bcp
import torch
import torch.distributed as dist

from bcpbench import fsdp1, memory, methods
from bcpbench.methods import FIRST_SAVE, Bcp, Dcp, RawFiles
from bcpbench.record import Record
from bcpbench.rounds import Entry, Group, Load, keep_phases, run_rounds, saving
from bcpbench.state import (
    Derived,
    gpt_shapes,
    local_piece,
    local_shape,
    random_state,
    random_tensor,
    shapes_nbytes,
    shard_dim,
    zeros_in_one_block,
)

SAVE_SHARDED = "save, 2 processes, DTensor Shard(0)"
COLD_SAME = "load cold, same layout, 2 processes"
WARM_SAME = "load warm, same layout, 2 processes"
RESHARDED = "load cold, resharded Shard(0) -> Shard(1), 2 processes"
SAVE_COLUMNS = "save, 2 processes, DTensor Shard(1)"
ROWS_FROM_COLUMNS = "load cold, resharded Shard(1) -> Shard(0), 2 processes"
TO_ONE = "load cold, resharded 2 -> 1 process"
SAVE_REPLICATED = "save, 2 processes, DP-replicated"
LOAD_REPLICATED = "load cold, DP-replicated (each process loads all), 2 processes"
READ_ONCE = "bcp, read_once=True"  # each byte read by one process and sent to the other over gloo
SEED = 1


def run(config: dict[str, Any]) -> dict:
    """Each case builds only what it needs (a whole state per process only where every process
    holds one), so the processes' memory stays near that of the layouts under test."""
    record = Record()
    group = Group(dist.get_rank(), dist.barrier)
    shapes = gpt_shapes(config["size_bytes"])
    for case in (SAVE_SHARDED, COLD_SAME, WARM_SAME, RESHARDED, TO_ONE, SAVE_COLUMNS, ROWS_FROM_COLUMNS,
                 SAVE_REPLICATED, LOAD_REPLICATED):
        record.nbytes[case] = shapes_nbytes(shapes)
    cases = {
        "Shard(0) cases": lambda: sharded(record, config, group, shapes),
        "2 -> 1 case": lambda: to_one(record, config, group, shapes),
        "Shard(1) -> Shard(0) case": lambda: rows_from_columns(record, config, group, shapes),
        "DP-replicated cases": lambda: replicated(record, config, group, shapes),
        "FSDP1 cases": lambda: fsdp1.run(record, config, group),
    }
    for label, case in cases.items():
        if config.get("cases") and label not in config["cases"]:
            continue
        memory.reset_peak_rss()
        case()
        gc.collect()
        record.figures[f"peak RSS of a 2-process worker (rank 0), {label}"] = memory.peak_rss_bytes()
    return record.to_dict()


def sharded(record: Record, config: dict, group: Group, shapes: dict) -> None:
    rank, world, mesh = group.rank, dist.get_world_size(), _mesh()
    source = _cut(shapes, 0, rank, world, mesh)
    flat0, dest0 = _local_destination(shapes, 0, world, mesh)
    flat1, dest1 = _local_destination(shapes, 1, world, mesh)
    same, resharded = (_expected(shapes, dim, rank, world) for dim in (0, 1))

    def same_layout(loader: Any, method: str | None = None) -> list[Load]:
        return [Load(COLD_SAME, lambda p: loader.load(p, dest0), expected=same, reset=flat0.zero_, method=method),
                Load(WARM_SAME, lambda p: loader.load(p, dest0), cold=False, method=method)]

    def loads(loader: Any) -> list[Load]:
        return [*same_layout(loader),
                Load(RESHARDED, lambda p: loader.load(p, dest1), expected=resharded, reset=flat1.zero_)]

    def raw_loads(raw: RawFiles) -> list[Load]:
        return [Load(COLD_SAME, lambda p: raw.read(p, flat0)),
                Load(WARM_SAME, lambda p: raw.read(p, flat0), cold=False),
                Load(RESHARDED, lambda p: raw.read(p, flat1))]

    io = config["io_threads"]
    fresh = iter([bcp.TorchCoordinator(channel=f"bench-first-{i}") for i in range(config["reps"] + 1)])
    saver, first = Bcp(io_threads=io), Bcp(FIRST_SAVE, lambda: next(fresh), io)
    tuned = Dcp(config["dcp_threads"])
    raws = [RawFiles(1, f"rank{rank}"), RawFiles(io, f"rank{rank}")]
    entries = [Entry(raw.name, saving(raw, source), raw_loads(raw)) for raw in raws]
    entries += [
        Entry(saver.name, saving(saver, source),
              loads(saver) + same_layout(Bcp(io_threads=io, verify=False), "bcp, load with verify=False"),
              after_save=keep_phases(record, "2p", saver, group)),
        Entry(first.name, saving(first, source), after_save=keep_phases(record, "2p first", first, group)),
        Entry("DCP", saving(Dcp(), source), loads(Dcp())),
        Entry(tuned.name, saving(tuned, source)),
        Entry("memcpy", None, [Load(WARM_SAME, lambda p: methods.copy_into(dest0, source), cold=False)]),
    ]
    run_rounds(record, entries, SAVE_SHARDED, config["workdir"], config["reps"], group)
    if saver.last_load is not None:
        record.figures["bcp load phases, 2p (last load)"] = saver.last_load.seconds


def to_one(record: Record, config: dict, group: Group, shapes: dict) -> None:
    """Saved cut on rows by 2 processes, loaded whole by rank 0 alone (rank 1 waits); the saves are
    not recorded (the Shard(0) cases time them)."""
    rank, world, mesh = group.rank, dist.get_world_size(), _mesh()
    source = _cut(shapes, 0, rank, world, mesh)
    full_flat, full_dest = zeros_in_one_block(shapes) if group.is_root else (None, None)
    whole = _expected(shapes, None, rank, world)

    def load(loader: Any) -> list[Load]:
        return [Load(TO_ONE, lambda p: loader.load(p, full_dest), root_only=True, expected=whole,
                     reset=full_flat.zero_ if group.is_root else None)]

    io = config["io_threads"]
    raws = [RawFiles(1, f"rank{rank}"), RawFiles(io, f"rank{rank}")]
    entries = [Entry(raw.name, saving(raw, source),
                     [Load(TO_ONE, lambda p, raw=raw: raw.read(p, full_flat, every_rank=True), root_only=True)])
               for raw in raws]
    alone = Bcp(coordinator=bcp.SingleProcessCoordinator, io_threads=io)
    entries += [Entry(alone.name, saving(Bcp(io_threads=io), source), load(alone)),
                Entry("DCP", saving(Dcp(), source), load(Dcp(single_rank=True)))]
    run_rounds(record, entries, None, config["workdir"], config["reps"], group)


def rows_from_columns(record: Record, config: dict, group: Group, shapes: dict) -> None:
    """Saved cut on columns, loaded cut on rows: each target needs the top or bottom half of
    every saved piece, a contiguous half of its bytes (a reader of whole pieces reads twice that)."""
    rank, world, mesh = group.rank, dist.get_world_size(), _mesh()
    source = _cut(shapes, 1, rank, world, mesh)
    flat, dest = _local_destination(shapes, 0, world, mesh)
    rows = _expected(shapes, 0, rank, world)

    def load(loader: Any) -> list[Load]:
        return [Load(ROWS_FROM_COLUMNS, lambda p: loader.load(p, dest), expected=rows, reset=flat.zero_)]

    io = config["io_threads"]
    raws = [RawFiles(1, f"rank{rank}"), RawFiles(io, f"rank{rank}")]
    entries = [Entry(raw.name, saving(raw, source), [Load(ROWS_FROM_COLUMNS, lambda p, raw=raw: raw.read(p, flat))])
               for raw in raws]
    saver = Bcp(io_threads=io)
    entries += [Entry(saver.name, saving(saver, source), load(saver)), Entry("DCP", saving(Dcp(), source), load(Dcp()))]
    run_rounds(record, entries, SAVE_COLUMNS, config["workdir"], config["reps"], group)


def replicated(record: Record, config: dict, group: Group, shapes: dict) -> None:
    """Every process holds the whole state: the ideal writes each byte once, and each process
    then needs every byte back."""
    rank, world = group.rank, dist.get_world_size()
    full = random_state(shapes, SEED)
    full_flat, full_dest = zeros_in_one_block(shapes)
    names = sorted(full, key=lambda n: -full[n].numel())
    mine = {n: full[n] for n in itertools.islice(names, rank, None, world)}  # this rank's half, for the floor
    io = config["io_threads"]

    def loads(loader: Any, method: str | None = None) -> list[Load]:
        return [Load(LOAD_REPLICATED, lambda p: loader.load(p, full_dest), expected=full, reset=full_flat.zero_,
                     method=method)]

    raws = [RawFiles(1, f"rank{rank}"), RawFiles(io, f"rank{rank}")]
    entries = [Entry(raw.name, saving(raw, mine),
                     [Load(LOAD_REPLICATED, lambda p, raw=raw: raw.read(p, full_flat, every_rank=True))])
               for raw in raws]
    saver, tuned = Bcp(io_threads=io), Dcp(config["dcp_threads"])
    entries += [
        Entry(saver.name, saving(saver, full),
              loads(saver) + loads(Bcp(io_threads=io, read_once=True), READ_ONCE)),
        Entry("DCP", saving(Dcp(), full), loads(Dcp())),
        Entry(tuned.name, saving(tuned, full)),
    ]
    run_rounds(record, entries, SAVE_REPLICATED, config["workdir"], config["reps"], group)


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _cut(shapes: dict, dim: int, rank: int, world: int, mesh: Any) -> dict:
    """This rank's DTensors of the state cut on ``dim``, built one global tensor at a time."""
    out = {}
    for name, shape in shapes.items():
        whole = random_tensor(shapes, name, SEED)
        out[name] = _dtensor(local_piece(whole, dim, rank, world).clone(), shape, dim, mesh)
    return out


def _expected(shapes: dict, dim: int | None, rank: int, world: int) -> Derived:
    """What a load must give this rank: its cut on ``dim``, or whole tensors (``None``)."""
    def make(name: str) -> torch.Tensor:
        whole = random_tensor(shapes, name, SEED)
        return whole if dim is None else local_piece(whole, dim, rank, world)
    return Derived(list(shapes), make)


def _dtensor(local: torch.Tensor, shape: tuple[int, ...], dim: int, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, [Shard(shard_dim(shape, dim))], run_check=False, shape=shape, stride=stride)


def _local_destination(shapes: dict, dim: int, world: int, mesh: Any) -> tuple[torch.Tensor, dict]:
    """Zeroed DTensors cut on ``dim``, their local parts views of one flat block."""
    flat, locals_ = zeros_in_one_block({n: local_shape(s, dim, world) for n, s in shapes.items()})
    return flat, {n: _dtensor(locals_[n], s, dim, mesh) for n, s in shapes.items()}
