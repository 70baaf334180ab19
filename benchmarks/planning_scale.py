"""Planning at scale: the coordinator's work for a Llama-405B-shaped model on 8,960 ranks
(TP8 x PP16 x DP70), from shapes only, in one process.

Every rank's local plan is built as bcp builds it (parameters TP-sharded and replicated over DP;
AdamW states and fp32 master weights cut into flat ranges over DP, as a distributed optimizer does,
each range decomposed into boxes), packed with msgpack as it would cross the wire, then timed:
unpack + global plan (dedup, worst-fit, coverage) + manifest assembly (every rank's report of its
writes unpacked and turned into the shard table) + manifest JSON, with the garbage collector paused
as in ``bcp.save``; the coordinator's plan phase on a cache hit (its structure comparison and the
agreement on reuse, every rank's flag gathered and answered); and the manifest's parse at load time. The same plans are then given to DCP's planner for comparison
(``--dcp``), as DCP would receive them; and a manifest of a million shards is loaded. With
``--grpc-nodes N``, the gRPC coordinator's planning exchange is measured on N real nodes and
extrapolated to 512, 2,048 and 8,960 ranks (``grpc_tree_costs.py`` says exactly how); with
``--flat-ranks P``, the torch.distributed coordinator's and DCP's flat exchanges likewise, from P
real gloo ranks (``flat_collective_costs.py``). ``--scaling-only`` runs those alone.

    .venv/bin/python benchmarks/planning_scale.py [--dp 70] [--dcp] [--grpc-nodes 64] [--flat-ranks 8]
        [--scaling-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from bcp.api.gc_pause import paused_gc
from bcp.coord.consensus import Outcome, gather_then_reply, pack, unpack
from bcp.layout.box import flat_range_to_boxes
from bcp.layout.manifest import DEFAULT_CHECKSUM_CHUNK, Manifest
from bcp.layout.local_plan import LocalPlan
from bcp.layout.write_plan import RankAssignment
from bcp.layout.write_report import PieceRecord, RankWrites, WrittenPieces
from bcp.planning.assembly import assemble_manifest
from bcp.planning.save_plan import PlanColumns, global_plan

LAYERS, HIDDEN, FFN, KV_HEADS, HEAD_DIM, VOCAB = 126, 16384, 53248, 8, 128, 128256
CHUNK = DEFAULT_CHECKSUM_CHUNK


def layer_params() -> list[tuple[str, tuple[int, int], int]]:
    """(name, global shape, TP-sharded dim or -1) of one transformer layer."""
    kv = KV_HEADS * HEAD_DIM
    return [("attn.q", (HIDDEN, HIDDEN), 0), ("attn.k", (kv, HIDDEN), 0), ("attn.v", (kv, HIDDEN), 0),
            ("attn.o", (HIDDEN, HIDDEN), 1), ("mlp.gate", (FFN, HIDDEN), 0), ("mlp.up", (FFN, HIDDEN), 0),
            ("mlp.down", (HIDDEN, FFN), 1), ("norm1", (HIDDEN,), -1), ("norm2", (HIDDEN,), -1)]


def stage_params(pp: int, stages: int) -> list[tuple[str, tuple[int, ...], int]]:
    per = math.ceil(LAYERS / stages)
    params = [(f"layers.{i}.{n}", s, d) for i in range(pp * per, min(LAYERS, (pp + 1) * per))
              for n, s, d in layer_params()]
    if pp == 0:
        params.insert(0, ("embed", (VOCAB, HIDDEN), 0))
    if pp == stages - 1:
        params += [("final_norm", (HIDDEN,), -1), ("lm_head", (VOCAB, HIDDEN), 0)]
    return params


def tp_box(shape: tuple[int, ...], dim: int, tp: int, tps: int) -> tuple[list[int], list[int]]:
    offsets, lengths = [0] * len(shape), list(shape)
    if dim >= 0:
        size = shape[dim] // tps
        offsets[dim], lengths[dim] = tp * size, size
    return offsets, lengths


def local_plan(tp: int, tps: int, pp: int, pps: int, dp: int, dps: int) -> LocalPlan:
    """One rank's plan (``bcp.layout.local_plan.LocalPlan``)."""
    declared, rows = [], []
    params = stage_params(pp, pps)
    for name, shape, dim in params:
        offsets, lengths = tp_box(shape, dim, tp, tps)
        rows.append([len(declared), offsets, lengths])
        declared.append((f"model/{name}", "bfloat16", tuple(shape)))
    # Distributed optimizer: this TP-PP rank's shards, flattened and concatenated, cut over DP.
    local_numels = [math.prod(tp_box(s, d, tp, tps)[1]) for _, s, d in params]
    total = sum(local_numels)
    start, end = total * dp // dps, total * (dp + 1) // dps
    position = 0
    for (name, shape, dim), numel in zip(params, local_numels):
        lo, hi = max(start, position), min(end, position + numel)
        if lo < hi:
            local_shape = tp_box(shape, dim, tp, tps)
            for state in ("exp_avg", "exp_avg_sq", "fp32_param"):
                index = len(declared)
                declared.append((f"optimizer/state/{name}/{state}", "float32", tuple(shape)))
                for box, _ in flat_range_to_boxes(local_shape[1], lo - position, hi - lo):
                    rows.append([index, [o + b for o, b in zip(local_shape[0], box.offsets)], list(box.lengths)])
        position += numel
    tensor = np.array([r[0] for r in rows], dtype=np.int64)
    offsets = np.array([r[1] + [0] * (2 - len(r[1])) for r in rows], dtype=np.int64)
    lengths = np.array([r[2] + [1] * (2 - len(r[2])) for r in rows], dtype=np.int64)
    return LocalPlan(declared, 2, tensor, offsets, lengths)


def dcp_save_plans(plans: list[LocalPlan]) -> list:
    """DCP's local plans for the same pieces: one WriteItem per piece, as DCP's local plans hold."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    dcp_plans = []
    for plan in plans:
        declared = plan.tensors
        tensor, offsets, lengths = plan.tensor, plan.offsets, plan.lengths
        items = []
        for t, o, n in zip(tensor.tolist(), offsets.tolist(), lengths.tolist()):
            name, dtype, shape = declared[t]
            ndim = len(shape)
            items.append(WriteItem(
                index=MetadataIndex(name, torch.Size(o[:ndim])), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(o[:ndim]), torch.Size(n[:ndim])),
                                            properties=TensorProperties(dtype=dtypes[dtype]), size=torch.Size(shape))))
        dcp_plans.append(SavePlan(items, planner_data={name: (name,) for name, _, _ in declared}))
    return dcp_plans


def dcp_planning(plans: list[LocalPlan]) -> dict:
    """DCP's coordinator on the same pieces."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    t0 = time.perf_counter()
    dcp_plans = dcp_save_plans(plans)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    DefaultSavePlanner().create_global_plan(dcp_plans)
    return {"dcp_items": sum(len(p.items) for p in dcp_plans), "dcp_build_items_s": round(built, 1),
            "dcp_global_plan_s": round(time.perf_counter() - t0, 2)}


def dcp_exchange(plans: list[LocalPlan]) -> tuple[list[int], list[int], float]:
    """DCP's planning exchange on the same pieces: each rank's pickled local plan (up) and pickled
    share of the global plan (down), as ``gather_object``/``scatter_object_list`` carry them, and
    the root's own work on them (unpickle, ``create_global_plan``, pickle the shares), measured."""
    import pickle

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    wire = [pickle.dumps(plan) for plan in dcp_save_plans(plans)]
    t0 = time.perf_counter()
    shares, _ = DefaultSavePlanner().create_global_plan([pickle.loads(w) for w in wire])
    replies = [pickle.dumps(share) for share in shares]
    return [len(w) for w in wire], [len(r) for r in replies], time.perf_counter() - t0


def parse_at(count: int) -> dict:
    """Time to load (parse and validate) a manifest with ``count`` shards of 2-D tensors."""
    from bcp.layout.manifest import TensorEntry
    from bcp.layout.shard_table import ShardTable

    per_tensor = 100
    tensors = count // per_tensor
    rows = np.arange(tensors * per_tensor)
    offsets = np.stack([rows % per_tensor, np.zeros_like(rows)], axis=1).astype(np.int64)
    lengths = np.tile(np.array([[1, 1024]], dtype=np.int64), (len(rows), 1))
    table = ShardTable(offsets, lengths, np.zeros(len(rows), dtype=np.int64), rows * 4096,
                       np.full(len(rows), 4096, dtype=np.int64), np.arange(len(rows) + 1, dtype=np.int64),
                       np.zeros(len(rows), dtype=np.uint32))
    entries = {f"t{i}": TensorEntry.from_table(f"t{i}", "float32", (per_tensor, 1024), table, i * per_tensor,
                                               per_tensor) for i in range(tensors)}
    manifest = Manifest(generation=1, world_size=1, framework="plain", files=["data/00000-00.bin"],
                        tensors=entries, objects={}, checksum_chunk=CHUNK)
    data, table_bytes = manifest.encode()
    t0 = time.perf_counter()
    Manifest.decode(data, table_bytes)
    return {"parse_shards": len(rows), "parse_mb": round((len(data) + len(table_bytes)) / 1e6, 1),
            "parse_s": round(time.perf_counter() - t0, 2)}


def rank_writes(plan: LocalPlan, assignment: RankAssignment) -> list:
    """What a rank reports after writing its ``assignment`` of ``plan`` into one file (synthetic
    checksums), as plain data."""
    rows, offset = [], 0
    parts = [(index, None, plan.lengths[index]) for index in assignment.whole]
    parts += [(part.index, part, part.lengths) for part in assignment.parts]
    for index, part, shape in parts:
        size = 2 if plan.tensors[plan.tensor[index]][1] == "bfloat16" else 4
        nbytes = int(np.prod(shape)) * size
        rows.append(PieceRecord(index, part.offsets if part else None, part.lengths if part else None, 0, offset,
                                nbytes, [0] * max(1, -(-nbytes // CHUNK))))
        offset += nbytes
    return RankWrites(["data/00000-00.bin"], WrittenPieces.of(rows), [], False).to_wire()


class SimulatedRoot:
    """Rank 0 of ``world`` ranks whose gather hands it every other rank's prepacked message (what the
    transport would deliver), so the real consensus code runs; the network's latency is not included."""

    rank = 0

    def __init__(self, world: int, others: list[bytes]) -> None:
        self.world_size, self._others = world, others

    def gather_bytes(self, data: bytes) -> list[bytes]:
        return [data, *self._others]

    def scatter_bytes(self, parts: list[bytes] | None) -> bytes:
        assert parts is not None and len(parts) == self.world_size
        return parts[0]


def structure_of(plan: LocalPlan) -> tuple:
    """A rank's structure key (``bcp.planning.save_plan.structure_key``) rebuilt from its local plan."""
    declared = plan.tensors
    return (tuple((name, dtype, tuple(shape)) for name, dtype, shape in declared),
            [(declared[t][0], tuple(o), tuple(n)) for t, o, n in zip(plan.tensor.tolist(), plan.offsets.tolist(),
                                                                     plan.lengths.tolist())])


def cached_replan(plan: LocalPlan, world: int) -> float:
    """Seconds of rank 0's plan phase on a cache hit, as in ``bcp.save``: its structure key compared
    with the cached plan's (two keys built apart, so the comparison walks them), then one flag per
    rank gathered and the agreement (with the generation) sent back."""
    cached, live = structure_of(plan), structure_of(plan)
    others = [Outcome(True).packed(rank) for rank in range(1, world)]
    coordinator = SimulatedRoot(world, others)
    t0 = time.perf_counter()
    hit = cached == live
    reply = gather_then_reply(coordinator, Outcome(hit), lambda flags: [[2, all(flags)]] * world, "re-planning")
    elapsed = time.perf_counter() - t0
    assert reply == [2, True]
    return elapsed


SCALES = (512, 2048, 8960)


def rank_plans(tp: int, pp: int, world: int) -> list[LocalPlan]:
    dp = world // (tp * pp)
    return [local_plan(r % tp, tp, (r // tp) % pp, pp, r // (tp * pp), dp) for r in range(world)]


def bcp_exchange(plans: list[LocalPlan]) -> tuple[list[int], list[int], float]:
    """bcp's planning exchange: each rank's packed local plan (up) and packed share of the global
    plan (down), and the root's own work on them (unpack and global plan), measured."""
    wire = [Outcome(plan.to_wire()).packed(r) for r, plan in enumerate(plans)]
    with paused_gc():
        t0 = time.perf_counter()
        unpacked = [LocalPlan.from_wire(unpack(w)[1]) for w in wire]
        replies = [share.to_wire() for share in global_plan(PlanColumns(unpacked))]
        planned = time.perf_counter() - t0
    return [len(w) for w in wire], [len(pack([True, reply])) for reply in replies], planned


def with_root(row: dict, planned: float) -> dict:
    return row | {"root_plan_s": round(planned, 2), "total_s": round(row["gather_s"] + planned + row["scatter_s"], 2)}


def grpc_planning(tp: int, pp: int, nodes: int) -> dict:
    """The gRPC coordinator's first planning at 512, 2,048 and 8,960 ranks: the tree's exchange
    (modelled from costs measured on ``nodes`` real nodes) around the root's own planning (measured)."""
    from grpc_tree_costs import at_scale, measure

    costs = measure(nodes)
    rows = []
    for world in SCALES:
        up, down, planned = bcp_exchange(rank_plans(tp, pp, world))
        rows.append(with_root(at_scale(world, up, down, costs["_a"], costs["_b"]), planned))
    return {k: v for k, v in costs.items() if not k.startswith("_")} | {"grpc_at_scale": rows}


def flat_planning(tp: int, pp: int, processes: int) -> dict:
    """The torch.distributed coordinator's and DCP's first planning at 512, 2,048 and 8,960 ranks:
    flat collectives (modelled from costs measured on ``processes`` real gloo ranks) around each
    root's own planning (measured)."""
    from flat_collective_costs import at_scale, measure

    costs = measure(processes)
    torch_rows, dcp_rows = [], []
    for world in SCALES:
        plans = rank_plans(tp, pp, world)
        up, down, planned = bcp_exchange(plans)
        torch_rows.append(with_root(at_scale(world, up, down, costs["_costs"]), planned))
        up, down, planned = dcp_exchange(plans)
        dcp_rows.append(with_root(at_scale(world, up, down, costs["_costs"]), planned))
        print(json.dumps({"torch": torch_rows[-1], "dcp": dcp_rows[-1]}), flush=True)
    return ({k: v for k, v in costs.items() if not k.startswith("_")}
            | {"torch_at_scale": torch_rows, "dcp_at_scale": dcp_rows})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--dp", type=int, default=70)
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--dcp", action="store_true", help="also time DCP's planner on the same pieces")
    parser.add_argument("--grpc-nodes", type=int, default=0,
                        help="also model the gRPC coordinator's exchange from this many real nodes")
    parser.add_argument("--flat-ranks", type=int, default=0,
                        help="also model the torch.distributed coordinator's and DCP's exchanges from this "
                             "many real gloo ranks")
    parser.add_argument("--scaling-only", action="store_true",
                        help="only the modelled exchanges at 512, 2,048 and 8,960 ranks")
    parser.add_argument("--manifest-shards", type=int, default=1_000_000,
                        help="also time loading a manifest of this many shards")
    args = parser.parse_args()
    if args.scaling_only:
        figures = {}
        if args.grpc_nodes:
            figures.update(grpc_planning(args.tp, args.pp, args.grpc_nodes))
        if args.flat_ranks:
            figures.update(flat_planning(args.tp, args.pp, args.flat_ranks))
        print(json.dumps(figures, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f)
        return
    world = args.tp * args.pp * args.dp

    t0 = time.perf_counter()
    wire = [pack(local_plan(r % args.tp, args.tp, (r // args.tp) % args.pp, args.pp,
                            r // (args.tp * args.pp), args.dp).to_wire()) for r in range(world)]
    built = time.perf_counter() - t0
    pieces = sum(len(unpack(w)["tensor"]) // 8 for w in wire)

    with paused_gc():  # as in bcp.save, which runs the coordinator's work with the collector paused
        t0 = time.perf_counter()
        plans = [LocalPlan.from_wire(unpack(w)) for w in wire]
        unpacked = time.perf_counter() - t0
        t0 = time.perf_counter()
        columns = PlanColumns(plans)
        writes_plan = global_plan(columns)
        planned = time.perf_counter() - t0

        # Every rank reports where it wrote its share (synthetic byte locations), as after a save.
        written = [pack(rank_writes(plans[rank], share)) for rank, share in enumerate(writes_plan)]
        t0 = time.perf_counter()
        manifest = assemble_manifest(generation=1, framework="megatron", checksum_chunk=CHUNK, writer="bench",
                                     columns=columns, reports=[RankWrites.from_wire(unpack(w)) for w in written])
        data, table = manifest.encode()
        assembled = time.perf_counter() - t0
        cached = cached_replan(plans[0], world)
    shards = sum(len(e.shards) for e in manifest.tensors.values())
    t0 = time.perf_counter()
    Manifest.decode(data, table)
    parsed = time.perf_counter() - t0

    figures = {
        "ranks": world, "local_pieces": pieces, "stored_shards": shards,
        "plans_mb": round(sum(map(len, wire)) / 1e6, 1), "manifest_mb": round((len(data) + len(table)) / 1e6, 1),
        "unpack_s": round(unpacked, 2), "global_plan_s": round(planned, 2),
        "manifest_build_s": round(assembled, 2), "coordinator_total_s": round(unpacked + planned + assembled, 2),
        "cached_replan_s": round(cached, 4),
        "cached_replan_share_pct": round(100 * cached / (unpacked + planned), 2),
        "manifest_parse_s": round(parsed, 2), "simulate_s": round(built, 1),
    }
    if args.dcp:
        figures.update(dcp_planning(plans))
        figures["dcp_over_bcp"] = round(figures["dcp_global_plan_s"] / figures["coordinator_total_s"], 1)
    if args.grpc_nodes:
        figures.update(grpc_planning(args.tp, args.pp, args.grpc_nodes))
    if args.flat_ranks:
        figures.update(flat_planning(args.tp, args.pp, args.flat_ranks))
    figures.update(parse_at(args.manifest_shards))
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f)


if __name__ == "__main__":
    main()
