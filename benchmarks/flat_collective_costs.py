"""Planning exchanges over flat collectives at scale (``planning_scale.py --flat-ranks P``): the
torch.distributed coordinator's and DCP's, from per-rank and per-byte costs measured on real gloo
ranks, then the exchange of a large job timed from them, as ``grpc_tree_costs.py`` does for the tree.

Measured: ``P`` real processes on loopback (one gloo group, bcp's ``TorchCoordinator``) run rounds
of a gather and a scatter of messages of two sizes above the inline block. Both collectives are
rooted and flat: the root exchanges one fixed 256-byte block with every rank (gloo's ring allgather
in a gather, a scatter in a scatter), then every rank's message padded to the largest one. So each
fits ``time = (P - 1) * (a + b * (256 + size))`` (``a``: one rank's share of the two steps, ``b``:
one byte into or out of the root). The processes share this machine's cores, so these are upper
bounds for a job with a machine per rank.

Extrapolated: an exchange over ``N`` ranks costs ``(N - 1) * (a + b * (256 + largest message))``,
the gather with the largest local plan, the scatter with the largest share of the global plan; the
root holds ``N`` padded messages. DCP sends pickled plans the same way (``gather_object`` /
``scatter_object_list``: the sizes first, then every message padded to the largest), so its rows
use the same costs with its own pickled message sizes.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket
import time

HEADER = 256  # bcp's fixed block (torch_dist.BLOCK_BYTES); DCP's size exchange is smaller
SMALL, LARGE, ROUNDS = 4 << 10, 4 << 20, 10


def measure(processes: int) -> dict:
    """Per-rank and per-byte costs of flat gathers and scatters on ``processes`` real gloo ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, processes, port, results)) for r in range(processes)]
    for p in procs:
        p.start()
    seconds = results.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    costs = {}
    for op in ("gather", "scatter"):
        small, large = seconds[op, SMALL], seconds[op, LARGE]
        per_byte = (large - small) / ((processes - 1) * (LARGE - SMALL))
        costs[op] = (small / (processes - 1) - per_byte * (HEADER + SMALL), per_byte)
    return {"flat_real_ranks": processes,
            **{f"flat_{op}_per_rank_us": round(a * 1e6, 1) for op, (a, _) in costs.items()},
            **{f"flat_{op}_per_mb_ms": round(b * 1e9, 2) for op, (_, b) in costs.items()},
            "_costs": costs}


def at_scale(world: int, up_bytes: list[int], down_bytes: list[int], costs: dict) -> dict:
    """The exchange's modelled time and what the root holds, for messages of these sizes."""
    (ga, gb), (sa, sb) = costs["gather"], costs["scatter"]
    widest_up, widest_down = max(up_bytes), max(down_bytes)
    return {"ranks": world, "gather_s": round((world - 1) * (ga + gb * (HEADER + widest_up)), 3),
            "scatter_s": round((world - 1) * (sa + sb * (HEADER + widest_down)), 3),
            "root_receives_mb": round((world - 1) * widest_up / 1e6, 1),
            "root_holds_mb": round(world * (widest_up + widest_down) / 1e6, 1)}


def _rank(rank: int, world: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from bcp.coord import TorchCoordinator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    coordinator = TorchCoordinator()
    seconds = {}
    for size in (SMALL, LARGE):
        coordinator.gather_bytes(b"w" * size)  # warm-up: connections and buffers
        for op in ("gather", "scatter"):
            coordinator.all_gather_bytes(b"")  # start together
            t0 = time.perf_counter()
            for _ in range(ROUNDS):
                if op == "gather":
                    coordinator.gather_bytes(b"g" * size)
                else:
                    coordinator.scatter_bytes([b"s" * size] * world if rank == 0 else None)
            seconds[op, size] = (time.perf_counter() - t0) / ROUNDS
    if rank == 0:
        results.put(seconds)
    dist.destroy_process_group()
