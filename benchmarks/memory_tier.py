"""The memory tier beside storage: 4 ranks as 2 nodes of 2 (``MemoryTier(nodes=...)``), a state
sharded over the ranks (a DTensor per tensor, Shard(0)). For each round, in one set of fresh
processes:

- save: blocking and total time of a synchronous and an asynchronous save to storage (a folder on
  the local disk) and to the memory tier (node folders under /dev/shm, 1 peer copy each);
- recovery: a load from storage, from the whole tier, and from the tier after one node's folder is
  deleted (its ranks fetch their bytes from the other node);
- memory: the bytes each node's folder holds, beside the bytes of its ranks' shards.

Times are the slowest rank's, medians over the rounds.

    .venv/bin/python benchmarks/memory_tier.py                 # 256 MB state, 3 rounds
    .venv/bin/python benchmarks/memory_tier.py --size-mb 512 --rounds 5

The storage folder is in the page cache when it is loaded (it was just written): storage loads
here are the best case for storage.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bcpbench.launch import launch  # noqa: E402

NODES = ["a", "a", "b", "b"]


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _timed(work: Callable[[], Any]) -> tuple[float, Any]:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    out = work()
    return _slowest(time.perf_counter() - started), out


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def run_rank(config: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import bcp

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    per_tensor = 16 << 20
    count = max(1, config["size_bytes"] // per_tensor)
    rows = per_tensor // 4 // 1024 // world
    generator = torch.Generator().manual_seed(rank)
    state = {"model": {f"layer{i}": DTensor.from_local(torch.randn(rows, 1024, generator=generator), mesh,
                                                        [Shard(0)]) for i in range(count)}}
    shard_bytes = sum(t.to_local().numel() * 4 for t in state["model"].values())
    storage, tier_dir = config["storage"], config["tier"]
    tier = bcp.MemoryTier(None, local_dir=tier_dir, nodes=NODES)
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    def save_both(target: Any, label: str) -> None:
        record(f"{label} sync save", _timed(lambda: bcp.save(target, state))[0])
        dist.barrier()
        started = time.perf_counter()
        handle = bcp.save(target, state, async_save=True)
        record(f"{label} async save: blocking", _slowest(time.perf_counter() - started))
        handle.wait()
        record(f"{label} async save: total", _slowest(time.perf_counter() - started))

    for _ in range(config["rounds"]):
        save_both(storage, "storage")
        save_both(tier, "tier")
        record("storage load", _timed(lambda: bcp.load(storage, state))[0])
        record("tier load (every node)", _timed(lambda: bcp.load(tier, state))[0])
        held = _folder_bytes(os.path.join(tier_dir, f"node-{NODES[rank]}"))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(tier_dir, "node-b"))
        seconds, result = _timed(lambda: bcp.load(tier, state))
        assert result.source == "memory", result.source_reason
        record("tier load (node b replaced)", seconds)
    return {"times": {name: statistics.median(values) for name, values in times.items()},
            "state_bytes": shard_bytes * world, "node_shard_bytes": shard_bytes * 2, "node_folder_bytes": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import memory_tier  # spawned workers import the function by its module name, which __main__ is not

    storage = tempfile.mkdtemp(prefix="bcp-bench-storage-", dir=os.environ.get("BCP_BENCH_DIR", "/var/tmp"))
    tier = tempfile.mkdtemp(prefix="bcp-bench-tier-", dir="/dev/shm")
    try:
        out = launch(memory_tier.run_rank, 4, {"size_bytes": int(args.size_mb * (1 << 20)), "rounds": args.rounds,
                                               "storage": storage, "tier": tier}, timeout_s=1800)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(tier, ignore_errors=True)
    print(f"state {out['state_bytes'] / 1e6:.0f} MB over 4 ranks (2 nodes x 2), {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.2f}; storage: {storage}")
    for name, seconds in out["times"].items():
        print(f"  {name:34s} {seconds:8.3f} s")
    print(f"  memory per node: its shards {out['node_shard_bytes'] / 1e6:.0f} MB, its tier folder "
          f"{out['node_folder_bytes'] / 1e6:.0f} MB (own files and one peer's copies)")


if __name__ == "__main__":
    main()
