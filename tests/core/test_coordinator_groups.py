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
import weakref

import torch
import torch.distributed as dist

import bcp

CYCLES = 50
STEADY_S = 0.2
STEADY_WAIT_S = 10.0


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
    """The counts once two looks ``STEADY_S`` apart agree, looked at for at most ``STEADY_WAIT_S``."""
    deadline = time.monotonic() + STEADY_WAIT_S
    previous, counts = None, resources()
    while counts != previous and time.monotonic() < deadline:
        time.sleep(STEADY_S)
        previous, counts = counts, resources()
    return counts


def back_to(baseline: dict) -> dict:
    """The counts once none is above ``baseline``, looked at every ``STEADY_S`` for at most
    ``STEADY_WAIT_S`` (well within the process group's timeout: a rank still looking must never
    make its peer's next collective time out). A destroyed gloo group's sockets are closed by its
    own loop thread, which a loaded machine may not run for a while, so two equal looks prove
    nothing there; a leak stays above the baseline and is returned as it is."""
    deadline = time.monotonic() + STEADY_WAIT_S
    counts = resources()
    while any(counts[name] > baseline[name] for name in counts) and time.monotonic() < deadline:
        time.sleep(STEADY_S)
        counts = resources()
    return counts


def at_most(counts: dict, baseline: dict) -> bool:
    return all(counts[name] <= baseline[name] for name in counts)


def recreated_groups(path: str) -> dict:
    """A job that re-creates its process group (elastic restarts, Megatron's re-initialization): a group
created, saved through (sync and async), destroyed, again and again. Each cycle's counts are taken
once the job has dropped its own references to the destroyed group: torch closes a gloo group's
sockets when its last reference goes, and a peer closes its end of a socket whose other end closed
only when its own loop gets to it, so counts taken while the group is still referenced would depend
on how far the other rank has come."""
    bcp.save(path, state(-1.0), async_save=True).wait()  # warm: the background lane, the world's side groups
    dist.barrier()
    before = steady()  # an earlier case's thread that ends later only lowers the counts after it
    during, released = [], []
    for cycle in range(CYCLES):
        group = dist.new_group([0, 1])
        coordinator = bcp.TorchCoordinator(group)
        bcp.save(path, state(float(cycle)), coordinator=coordinator)
        bcp.save(path, state(cycle + 0.5), coordinator=coordinator, async_save=True).wait()
        dist.destroy_process_group(group)  # shuts the group's side groups down: their threads leave
        gone = weakref.ref(group)
        del coordinator, group  # as a loop that rebinds them does
        released.append(gone() is None)  # bcp holds nothing of a finished save, its coordinator included
        dist.barrier()  # both ranks have let their group go: no socket end waits for the peer
        during.append(back_to(before))
        flat = torch.tensor([int(at_most(during[-1], before))])
        dist.all_reduce(flat, op=dist.ReduceOp.MIN)
        if not flat.item():  # a leak: stop here (both ranks), the test names the cycle
            break
    world = bcp.TorchCoordinator()
    return {"before": before, "during": during, "released": released, "after": back_to(before),
            "loaded": loaded(path, world)}


def test_recreated_groups_keep_threads_and_files_flat(ranks, tmp_path):
    for result in ranks(2).run(recreated_groups, str(tmp_path / "ckpt")):
        before = result["before"]
        assert all(at_most(counts, before) for counts in result["during"]), (before, result["during"])
        assert len(result["during"]) == CYCLES
        assert all(result["released"]), result["released"]
        assert at_most(result["after"], before), (before, result["after"])
        assert result["loaded"] == [[CYCLES - 0.5] * 6, {"value": CYCLES - 0.5}]


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
