"""The gRPC coordinator's planning exchange at scale (``planning_scale.py --grpc-nodes N``): per-call
and per-byte costs measured on real nodes, then the tree of a large job timed from them.

Measured: ``N`` real ``GrpcCoordinator`` nodes (threads of this process on loopback, in the tree the
job would use: 8 ranks per machine, fan-out 8) run rounds of a gather and a scatter, once with small
and once with large messages. The two totals fit ``time = a * calls + b * bytes`` (``a``: one call,
``b``: one byte carried one edge). The threads share this process and its cores, so ``a`` and ``b``
charge each call and byte the CPU of both of its ends and any wait for the interpreter: an upper
bound on what one node spends when every node has a machine of its own.

Extrapolated: in a job, nodes work in parallel and an exchange ends when the slowest chain to the
root does. A gather reaches the root at ``up(n) = max(up(children)) + a * fan_in(n) + b * bytes_in(n)``;
a scatter reaches rank c at ``down(c) = down(parent) + a + b * bytes of c's subtree's replies``, with
each rank's real message sizes (its packed local plan up, its packed share of the global plan down).
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from bcp.coord.grpc import GrpcCoordinator, Tree

RANKS_PER_MACHINE, FAN_OUT = 8, 8
SMALL, LARGE, ROUNDS = 256, 64 << 10, 5


def measure(nodes: int) -> dict:
    """Per-call and per-byte costs of gathers and scatters on ``nodes`` real nodes."""
    store = dist.HashStore()
    coordinators = _on_threads(nodes, lambda r: GrpcCoordinator(
        store=store, rank=r, world_size=nodes, timeout=300, ranks_per_machine=RANKS_PER_MACHINE,
        fan_out=FAN_OUT, namespace="bench"))
    try:
        seconds = {size: _rounds(coordinators, size) for size in (SMALL, LARGE)}
    finally:
        for c in coordinators:
            c.close()
    tree = coordinators[0].tree
    calls = 2 * (nodes - 1) * ROUNDS  # one per child, per gather and per scatter
    hops = 2 * sum(tree.depth(r) for r in range(nodes)) * ROUNDS  # every message crosses depth(r) edges
    per_byte = (seconds[LARGE] - seconds[SMALL]) / (hops * (LARGE - SMALL))
    per_call = (seconds[SMALL] - per_byte * hops * SMALL) / calls
    return {"grpc_real_nodes": nodes, "grpc_per_call_us": round(per_call * 1e6, 1),
            "grpc_per_mb_ms": round(per_byte * 1e9, 2), "_a": per_call, "_b": per_byte}


def at_scale(world: int, up_bytes: list[int], down_bytes: list[int], per_call: float, per_byte: float) -> dict:
    """The exchange's modelled time, the tree's depth and fan-in, and the largest message a node holds."""
    tree = Tree.build(world, RANKS_PER_MACHINE, FAN_OUT)
    order = sorted(range(world), key=tree.depth, reverse=True)  # children before parents
    subtree_up, up_done = list(up_bytes), [0.0] * world
    for rank in order:
        children = tree.children(rank)
        received = sum(subtree_up[c] for c in children)
        subtree_up[rank] += received
        up_done[rank] = max([up_done[c] for c in children], default=0.0) + per_call * len(children) + per_byte * received
    subtree_down = list(down_bytes)
    for rank in order:
        if tree.parents[rank] >= 0:
            subtree_down[tree.parents[rank]] += subtree_down[rank]
    down_done = [0.0] * world
    for rank in reversed(order):
        if tree.parents[rank] >= 0:
            down_done[rank] = down_done[tree.parents[rank]] + per_call + per_byte * subtree_down[rank]
    fan_in: dict[int, int] = {}
    for rank in range(world):
        depth = tree.depth(rank)
        fan_in[depth] = max(fan_in.get(depth, 0), len(tree.children(rank)))
    return {"ranks": world, "depth": max(tree.depth(r) for r in range(world)),
            "max_fan_in_by_depth": [fan_in[d] for d in sorted(fan_in)],
            "gather_s": round(up_done[0], 3), "scatter_s": round(max(down_done), 3),
            "root_receives_mb": round((subtree_up[0] - up_bytes[0]) / 1e6, 1),
            "largest_nonroot_subtree_mb": round(max(subtree_up[r] for r in range(1, world)) / 1e6, 1)}


def _rounds(coordinators: list[GrpcCoordinator], size: int) -> float:
    world = len(coordinators)

    def run(rank: int) -> None:
        for _ in range(ROUNDS):
            coordinators[rank].gather_bytes(b"g" * size)
            coordinators[rank].scatter_bytes([b"s" * size] * world if rank == 0 else None)

    t0 = time.perf_counter()
    _on_threads(world, run)
    return time.perf_counter() - t0


def _on_threads(count: int, fn) -> list:
    results: list = [None] * count
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as exc:  # re-raised below, on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
