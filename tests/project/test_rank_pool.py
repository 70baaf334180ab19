"""The rank pool itself: a case's process groups end with the case. Each gloo group keeps a loop
thread that wakes every 10 ms, so groups left in the session-long pool ranks took CPU from every
later test (a third of a core after the core tests, which starved the fresh processes of the
lifecycle tier on a loaded machine)."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from pool import process_groups


def groups_and_native_threads() -> tuple[int, int]:
    """Process groups registered with c10d, and the threads Python did not start (gloo's)."""
    with open("/proc/self/status") as f:
        threads = int(next(line for line in f if line.startswith("Threads:")).split()[1])
    return len(process_groups()), threads - threading.active_count()


def make_groups_and_a_mesh(world: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    for _ in range(3):
        group = dist.new_group(list(range(world)))
        dist.all_reduce(torch.ones(1), group=group)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    return float(sharded.full_tensor().sum())


def test_the_groups_a_case_made_are_gone_before_the_next(ranks):
    pool = ranks(2)
    before = pool.run(groups_and_native_threads)
    for _ in range(3):  # a mesh equal to the last case's gets groups of its own (DTensor caches cleared)
        assert pool.run(make_groups_and_a_mesh, 2) == [28.0, 28.0]
    assert pool.run(groups_and_native_threads) == before
