"""TorchCoordinator over process groups the job creates and destroys: bcp's gloo side groups live
as long as those groups (threads and open files stay flat over many re-creations), and only a
group's members take part in building them (each data-parallel group saves on its own).

Guards a past defect: bcp kept a side group per parent group, keyed by the parent's ``id()``, and never
destroyed it, so a loop that re-created its group grew its thread count each cycle and hung in its
third save."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

import bcp

CYCLES = 50


def resources() -> dict:
    """Python threads, OS threads (gloo's are C++ threads) and open file descriptors."""
    return {"python_threads": threading.active_count(), "os_threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd"))}


def state(value: float, size: int = 6) -> dict:
    return {"model": {"w": torch.full((size,), value)}, "extra_state": {"value": value}}


def loaded(path: str, coordinator: bcp.Coordinator, size: int = 6) -> list:
    out = {"model": {"w": torch.zeros(size)}, "extra_state": None}
    bcp.load(path, out, coordinator=coordinator)
    return [out["model"]["w"].tolist(), out["extra_state"]]


def steady() -> dict:
    """The counts once two looks 0.2 s apart agree (threads told to stop are gone)."""
    previous, counts = None, resources()
    while counts != previous:
        time.sleep(0.2)
        previous, counts = counts, resources()
    return counts


def settled(expected: dict) -> dict:
    """The counts once they equal ``expected``, or the last ones after 60s: an asynchronous save's
    worker thread may let go of its coordinator just after the save's handle reports it done."""
    deadline = time.monotonic() + 60
    while (counts := resources()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return counts


def recreated_groups(path: str) -> dict:
    """A job that re-creates its process group (elastic restarts, Megatron's re-initialization): a group
created, saved through (sync and async), destroyed, again and again."""
    bcp.save(path, state(-1.0), async_save=True).wait()  # warm: the background lane, the world's side groups
    before = resources()
    during = []
    for cycle in range(CYCLES):
        group = dist.new_group([0, 1])
        coordinator = bcp.TorchCoordinator(group)
        bcp.save(path, state(float(cycle)), coordinator=coordinator)
        bcp.save(path, state(cycle + 0.5), coordinator=coordinator, async_save=True).wait()
        dist.destroy_process_group(group)  # shuts the group's side groups down: their threads leave
        during.append(settled(during[0]) if during else steady())
    del coordinator, group  # the last side groups now have neither a live group nor a user
    world = bcp.TorchCoordinator()  # looking up a side group drops those of destroyed groups
    return {"before": before, "during": during, "after": settled(before), "loaded": loaded(path, world)}


def test_recreated_groups_keep_threads_and_files_flat(ranks, tmp_path):
    for result in ranks(2).run(recreated_groups, str(tmp_path / "ckpt")):
        assert result["loaded"] == [[CYCLES - 0.5] * 6, {"value": CYCLES - 0.5}]
        assert all(counts == result["during"][0] for counts in result["during"]), result["during"]
        assert result["after"] == result["before"]


def wait_for_file(path: str) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def subgroup_savers(root: str, rounds: int) -> list:
    """Ranks 0-1 and 2-3 form two data-parallel groups; each saves its own checkpoint through a
    coordinator over its own group, calling bcp while the other group is not calling it at all."""
    rank = dist.get_rank()
    results = []
    for round_ in range(rounds):
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # torch: every rank creates both
        index = rank // 2
        mine, path = groups[index], os.path.join(root, f"dp{index}")
        done = os.path.join(root, f"round{round_}-dp1-done")
        if index == 0:
            wait_for_file(done)  # group 1 saves and loads while group 0 sits outside bcp
        value = 10.0 * round_ + index
        coordinator = bcp.TorchCoordinator(mine)
        bcp.save(path, state(value + 0.25, size=4 + index), coordinator=coordinator)
        if index == 1:  # a different number and kind of saves than group 0
            bcp.save(path, state(value, size=5), coordinator=coordinator, async_save=True).wait()
        results.append(loaded(path, coordinator, size=4 + index))
        if index == 1 and coordinator.rank == 0:
            open(done, "w").close()
        dist.barrier()
        for group in groups:
            dist.destroy_process_group(group)
    return results


def test_data_parallel_groups_save_independently(ranks, tmp_path):
    rounds = 3
    results = ranks(4).run(subgroup_savers, str(tmp_path), rounds)
    for rank, per_round in enumerate(results):
        index = rank // 2
        expected = [10.0 * r + index + (0.25 if index == 0 else 0.0) for r in range(rounds)]
        assert per_round == [[[v] * (4 + index), {"value": v}] for v in expected]
