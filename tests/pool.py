"""A persistent pool of gloo ranks for multi-process tests.

Spawning ranks and importing torch costs seconds, so one pool per world size lives for the whole
session and runs many cases: ``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank and returns
the per-rank results. ``fn`` must be a module-level function. A case that fails raises here with
every failing rank's traceback; a case that hangs is cut off after ``CASE_TIMEOUT_S`` (the ranks
that did not answer are named and asked for their threads' stacks, which the test's captured stderr
shows) and the pool is rebuilt, so a deadlock costs minutes, not the CI limit. The process groups
a case makes are destroyed when it ends: a case cannot hand a group to the next.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from typing import Any, Callable

PG_TIMEOUT_S = 60
CASE_TIMEOUT_S = 300
STACKS_SIGNAL = signal.SIGUSR1


class CaseFailed(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, inbox: Any, outbox: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    outbox.put(("ready", rank, None))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        groups_before = process_groups()
        try:
            try:
                answer = ("ok", rank, fn(*args))
            finally:
                _destroy_groups_made_since(groups_before)  # before answering: a failure here is the case's
        except BaseException:  # report everything, including assertion failures, to the test
            answer = ("error", rank, traceback.format_exc())
        outbox.put(answer)
    dist.destroy_process_group()


def process_groups() -> set:
    """The process groups registered with c10d in this process (the world among them)."""
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map)


def _destroy_groups_made_since(before: set) -> None:
    """Each gloo group runs a loop thread that wakes every 10 ms for the life of the group. The
    groups a case made (device meshes, subgroups) would stay for the rest of the session with their
    threads, and the pools' idle ranks then took a third of a core from every later test, from the
    fresh processes of the lifecycle tier above all. A case cannot keep a group for the next one."""
    import torch.distributed as dist
    from torch.distributed.tensor import _redistribute, debug

    made = process_groups() - before
    for group in made:
        dist.destroy_process_group(group)
    if made:
        # DTensor's caches compare device meshes by shape and names, not groups: a spec cached by
        # this case would hand the next case's equal mesh this case's destroyed groups.
        debug._clear_sharding_prop_cache()
        _redistribute._gen_transform_infos.cache_clear()


class RankPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self.procs = [ctx.Process(target=_worker, args=(r, self.world_size, port, self.inboxes[r], self.outbox),
                                  daemon=True) for r in range(self.world_size)]
        for p in self.procs:
            p.start()
        for _ in range(self.world_size):
            kind, rank, _ = self.outbox.get(timeout=120)
            assert kind == "ready", (kind, rank)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        for inbox in self.inboxes:
            inbox.put((fn, args))
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        answered: set[int] = set()
        deadline = time.monotonic() + CASE_TIMEOUT_S
        for _ in range(self.world_size):
            try:
                kind, rank, value = self.outbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                hung = sorted(set(range(self.world_size)) - answered)
                self._ask_for_stacks(hung)
                self.restart()
                raise CaseFailed(f"{fn.__module__}.{fn.__name__} did not finish on rank(s) {hung} within "
                                 f"{CASE_TIMEOUT_S}s: it hangs (their threads' stacks are in the captured stderr); "
                                 "pool restarted") from None
            answered.add(rank)
            if kind == "ok":
                results[rank] = value
            else:
                errors[rank] = value
        if errors:
            raise CaseFailed("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return results

    def _ask_for_stacks(self, ranks: list[int]) -> None:
        for rank in ranks:
            if self.procs[rank].is_alive():
                os.kill(self.procs[rank].pid, STACKS_SIGNAL)
        time.sleep(2)  # time to write them

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for inbox, proc in zip(self.inboxes, self.procs):
            if proc.is_alive():
                inbox.put(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
