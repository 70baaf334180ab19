"""The asynchronous integrity barrier over the gRPC tree, on real ranks: each rank reports once its
writes are durable, the root commits once every rank has reported, training goes on meanwhile and the
next save's writes overlap the barrier; a rank failing before the commit leaves the previous
generation the latest; every rank's handle gives the outcome.

Order is proven by events appended to one log file shared by the ranks (``O_APPEND``: each line
lands whole, in the order the writes happened), never by timings."""

from __future__ import annotations

import os
import time

import torch

import bcp
from bcp.coord.grpc import GrpcCoordinator
from models import rank

GATE_S = 60.0  # the gate gives up (and the order assertions then fail) rather than hang


def log(events: str, line: str) -> None:
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def logged(events: str) -> list[str]:
    with open(events) as f:
        return f.read().splitlines()


class Observed(bcp.LocalStorage):
    """A real disk that logs each durable data file and each commit marker. On the coordinating rank
    the marker of generation ``gated`` waits until every line of ``awaits`` is in the log."""

    def __init__(self, root: str, events: str, gated: int = 0, awaits: tuple[str, ...] = ()) -> None:
        super().__init__(root)
        self.events, self.gated, self.awaits = events, gated, awaits

    def write_file(self, name: str, chunks) -> None:
        super().write_file(name, chunks)
        if "/data/" in name:
            log(self.events, f"durable {name}")

    def put_if_absent(self, name: str, data: bytes) -> bool:
        if name.endswith("COMMITTED"):
            if name.startswith(f"gen-{self.gated:08d}/"):
                deadline = time.monotonic() + GATE_S
                while not set(self.awaits) <= set(logged(self.events)) and time.monotonic() < deadline:
                    time.sleep(0.05)
            log(self.events, f"commit {name.split('/')[0]}")
        return super().put_if_absent(name, data)


class FailingWrites(bcp.LocalStorage):
    """A disk that refuses this rank's data files (a fault a test cannot cause for real per rank)."""

    def write_file(self, name: str, chunks) -> None:
        if "/data/" in name:
            raise OSError(28, "No space left on device", name)
        super().write_file(name, chunks)


def tree() -> GrpcCoordinator:
    return GrpcCoordinator(timeout=120, ranks_per_machine=1, fan_out=2)


def state_of(weights: torch.Tensor) -> dict:
    """Weights replicated over the ranks, and a value of each rank's own: every rank writes a file."""
    return {"model": {"w": weights}, "extra_state": {"rank": rank()}}


def data_file(generation: int, of_rank: int) -> str:
    return f"durable gen-{generation:08d}/data/{of_rank:05d}-00.bin"


def overlapping_case(path: str, events: str, world: int) -> list:
    """Save 1 (async); train a step; save 2 (async). The commit of 1 is held until every rank has
    trained and written save 2's data: it can only happen if neither waits for the barrier of 1."""
    awaits = tuple(f"trained {r}" for r in range(world)) + tuple(data_file(2, r) for r in range(world))
    storage = Observed(path, events, gated=1, awaits=awaits)
    weights = torch.arange(1024.0)
    with tree() as coordinator:
        first = bcp.save(storage, state_of(weights), coordinator=coordinator, async_save=True)
        log(events, f"returned {rank()}")
        weights.add_(1000.0)  # a training step
        log(events, f"trained {rank()}")
        second = bcp.save(storage, state_of(weights), coordinator=coordinator, async_save=True)
        outcomes = []
        for handle in (first, second):
            handle.wait()
            outcomes.append((handle.generation, handle.done()))
        log(events, f"waited {rank()}")
        loaded = {"model": {"w": torch.empty(1024)}}
        result = bcp.load(path, loaded, coordinator=coordinator)
    return [outcomes, result.generation, torch.equal(loaded["model"]["w"], weights)]


def test_the_commit_follows_every_report_while_training_and_the_next_writes_go_on(ranks, tmp_path):
    world, events = 2, str(tmp_path / "events")
    results = ranks(world).run(overlapping_case, str(tmp_path / "ckpt"), events, world)
    lines = logged(events)
    at = {line: i for i, line in enumerate(lines)}
    commit_1, commit_2 = at["commit gen-00000001"], at["commit gen-00000002"]
    for r in range(world):
        assert at[f"returned {r}"] < at[f"trained {r}"] < commit_1, lines  # save returned at staging
        assert at[data_file(1, r)] < commit_1, lines  # every rank reported before the commit
        assert at[data_file(2, r)] < commit_1, lines  # the next save's writes overlapped the barrier
        assert commit_2 < at[f"waited {r}"], lines  # every handle waited for its commit
    assert commit_1 < commit_2, lines  # commits in call order
    assert results == [[[(1, True), (2, True)], 2, True]] * world


def failing_case(path: str, victim: int) -> list:
    """Save 1 commits; save 2 fails on ``victim`` before its commit; save 3 commits."""
    weights = torch.arange(256.0)
    saved_first = weights.clone()
    with tree() as coordinator:
        bcp.save(path, state_of(weights), coordinator=coordinator, async_save=True).wait()
        weights.add_(1.0)
        storage = FailingWrites(path) if rank() == victim else bcp.LocalStorage(path)
        failed = bcp.save(storage, state_of(weights), coordinator=coordinator, async_save=True)
        try:
            failed.wait()
            error = None
        except bcp.CheckpointError as exc:
            error = str(exc)
        loaded = {"model": {"w": torch.empty(256)}}
        after_failure = bcp.load(path, loaded, coordinator=coordinator).generation
        still_first = torch.equal(loaded["model"]["w"], saved_first)
        bcp.save(path, state_of(weights), coordinator=coordinator, async_save=True).wait()
        after_next = bcp.load(path, loaded, coordinator=coordinator).generation
    return [error, after_failure, still_first, after_next, torch.equal(loaded["model"]["w"], weights)]


def test_a_rank_failing_before_the_commit_leaves_the_previous_generation_the_latest(ranks, tmp_path):
    victim = 1
    results = ranks(2).run(failing_case, str(tmp_path / "ckpt"), victim)
    for r, (error, after_failure, still_first, after_next, loads_third) in enumerate(results):
        assert error is not None and "No space left on device" in error, error  # every rank's handle raised
        if r != victim:  # the victim raises its own error; the others learn it from the barrier
            assert error.startswith("writing the checkpoint") and f"rank {victim}: StorageError" in error, error
        assert (after_failure, still_first) == (1, True)
        assert (after_next, loads_third) == (2, True)  # every rank reported: the failed generation went whole
