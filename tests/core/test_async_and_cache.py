"""Asynchronous saves (staging, call-order commits, errors, exit), the plan cache and its
invalidation, and the splitting of large replicated tensors across writers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

import bcp
from bcp.engine.location import METRICS_DIR
from bcp.integration import runtime
from models import assert_bitwise, build, full_state, rank, shard_files, train


def test_async_save_snapshots_state_at_call_time(tmp_path):
    model, optimizer = build("plain", seed=1)
    train(model, optimizer, range(2))
    expected = full_state(model, optimizer)
    handle = bcp.save(tmp_path, {"model": model, "optimizer": optimizer}, async_save=True)
    train(model, optimizer, range(2, 4))  # training goes on while the save writes
    handle.wait()
    assert handle.done() and {"plan", "stage", "write", "commit"} <= handle.stats.seconds.keys()
    fresh, fresh_opt = build("plain", seed=2)
    bcp.load(tmp_path, {"model": fresh, "optimizer": fresh_opt})
    assert_bitwise(expected, full_state(fresh, fresh_opt))


def test_async_saves_commit_in_call_order_and_reuse_buffers(tmp_path):
    state = {"w": torch.zeros(50_000)}
    handles = []
    for step in range(6):
        state["w"].fill_(step)
        handles.append(bcp.save(tmp_path, {"model": state}, async_save=True))
    bcp.wait_pending_saves()
    held = runtime().buffers.allocated_bytes
    assert 0 < held <= 2 * 200_064  # at most two buffer sets (ping-pong) of one save's bytes
    for step in range(6, 12):
        state["w"].fill_(step)
        handles.append(bcp.save(tmp_path, {"model": state}, async_save=True))
    bcp.wait_pending_saves()
    assert [h.generation for h in handles] == list(range(1, 13))
    assert runtime().buffers.allocated_bytes == held  # host memory stays flat across saves
    out = {"w": torch.empty(50_000)}
    assert bcp.load(tmp_path, {"model": out}).generation == 12
    assert torch.equal(out["w"], torch.full((50_000,), 11.0))


class _DataWritesFail(bcp.storage.LocalStorage):
    """A disk that refuses data files (a fault a test cannot cause on this disk for real)."""

    def write_file(self, name, chunks):
        if "/data/" in name:
            raise OSError(28, "No space left on device", name)
        super().write_file(name, chunks)


def test_async_save_error_is_raised_by_wait(tmp_path):
    handle = bcp.save(_DataWritesFail(tmp_path / "ckpt"), {"model": {"w": torch.ones(4)}}, async_save=True)
    try:
        handle.wait()
    except bcp.CheckpointError as exc:
        assert "ckpt" in str(exc)
    else:
        raise AssertionError("the failed background save must raise from wait()")


def test_process_exit_waits_for_pending_async_saves(tmp_path):
    script = textwrap.dedent(f"""
        import torch, bcp
        bcp.save({str(tmp_path)!r}, {{"model": {{"w": torch.arange(2_000_000.0)}}}}, async_save=True)
        # no wait(): the interpreter must not exit before the commit
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    out = {"w": torch.zeros(2_000_000)}
    bcp.load(tmp_path, {"model": out})
    assert torch.equal(out["w"], torch.arange(2_000_000.0))


class CountsCollectives:
    """Mixed into a real coordinator: counts its collectives (a gather and its scatter are two)."""

    collectives = 0

    def all_gather_bytes(self, data):
        type(self).collectives += 1
        return super().all_gather_bytes(data)

    def gather_bytes(self, data):
        type(self).collectives += 1
        return super().gather_bytes(data)

    def scatter_bytes(self, parts):
        type(self).collectives += 1
        return super().scatter_bytes(parts)

    def broadcast_bytes(self, data):
        type(self).collectives += 1
        return super().broadcast_bytes(data)


class CountingCoordinator(CountsCollectives, bcp.TorchCoordinator):
    collectives = 0


def cache_case(path: str) -> list[int]:
    """Collectives per save: a first save, an unchanged one (cache hit), one where only rank 1's
    shapes change (every rank must replan), and the changed structure again (hit)."""
    runtime().plan_cache.clear()
    coordinator = CountingCoordinator()
    counts = []
    for step, rows in enumerate([4, 4, 4 + rank(), 4 + rank()]):
        before = CountingCoordinator.collectives
        state = {f"r{rank()}": torch.full((rows, 3), float(step)), "shared": torch.ones(5)}
        bcp.save(f"{path}/{step}", {"model": state}, coordinator=coordinator)
        counts.append(CountingCoordinator.collectives - before)
        out = {f"r{rank()}": torch.zeros(rows, 3), "shared": torch.zeros(5)}
        bcp.load(f"{path}/{step}", {"model": out}, strict=False)
        assert torch.equal(out[f"r{rank()}"], state[f"r{rank()}"]) and torch.equal(out["shared"], torch.ones(5))
    return counts


def test_plan_cache_reuses_and_invalidates_on_any_rank_change(ranks, tmp_path):
    counts = ranks(2).run(cache_case, str(tmp_path))
    # uncached: the agreement (1 all-gather), the plan and the commit (a gather and a scatter each) = 5;
    # cached: the agreement and the commit = 3
    assert counts == [[5, 3, 5, 3]] * 2


class CountingSingleProcess(CountsCollectives, bcp.SingleProcessCoordinator):
    collectives = 0


def halves(tensor: torch.Tensor, cut: int) -> list:
    return [bcp.TensorShard(tensor[:cut], tuple(tensor.shape), (0, 0)),
            bcp.TensorShard(tensor[cut:], tuple(tensor.shape), (cut, 0))]


def test_plan_cache_replans_on_dtype_name_and_box_changes(tmp_path):
    """Each change of structure that keeps the byte count (dtype of the same size, a renamed tensor,
    the same tensor cut at another row) must replan; an unchanged structure must not."""
    runtime().plan_cache.clear()
    coordinator = CountingSingleProcess()
    base = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    steps = [
        ("first", {"w": base}, 5),
        ("unchanged, new values", {"w": base + 1}, 3),
        ("dtype of the same size", {"w": base.to(torch.int32)}, 5),
        ("renamed", {"v": base.to(torch.int32)}, 5),
        ("cut in two at row 2", {"v": halves(base, 2)}, 5),
        ("same cut", {"v": halves(base + 5, 2)}, 3),
        ("cut at row 1", {"v": halves(base + 5, 1)}, 5),
    ]
    for step, (what, model, collectives) in enumerate(steps):
        before = CountingSingleProcess.collectives
        bcp.save(tmp_path / str(step), {"model": model}, coordinator=coordinator)
        assert CountingSingleProcess.collectives - before == collectives, what
        name, value = next(iter(model.items()))
        expected = torch.cat([s.tensor for s in value]) if isinstance(value, list) else value
        out = {name: torch.zeros_like(expected)}
        bcp.load(tmp_path / str(step), {"model": out})
        assert torch.equal(out[name], expected), what


def split_case(path: str) -> list:
    from bcp.planning import save_plan

    original = save_plan.SPLIT_BYTES
    save_plan.SPLIT_BYTES = 1 << 10  # make a 40 KiB replicated tensor "very large"
    try:
        runtime().plan_cache.clear()
        big = torch.arange(10_000, dtype=torch.float32).reshape(100, 100)
        bcp.save(path, {"model": {"big": big}})
    finally:
        save_plan.SPLIT_BYTES = original
    out = {"big": torch.zeros(100, 100)}
    bcp.load(path, {"model": out})
    writers = sorted({f[5:10] for f in shard_files(path, "model/big")})
    return [torch.equal(out["big"], big), writers]


def test_large_replicated_tensor_is_split_across_writers(ranks, tmp_path):
    for equal, writers in ranks(2).run(split_case, str(tmp_path)):
        assert equal and writers == ["00000", "00001"]


def async_distributed_case(path: str) -> list:
    model, optimizer = build("fsdp2", seed=1)
    train(model, optimizer, range(2))
    expected = full_state(model, optimizer)
    first = bcp.save(path, {"model": model, "optimizer": optimizer}, async_save=True)
    train(model, optimizer, range(2, 3))
    second = bcp.save(path, {"model": model, "optimizer": optimizer}, async_save=True)
    expected_second = full_state(model, optimizer)
    train(model, optimizer, range(3, 4))
    first.wait()
    second.wait()
    fresh, fresh_opt = build("fsdp2", seed=2)
    bcp.load(path, {"model": fresh, "optimizer": fresh_opt})
    loaded = full_state(fresh, fresh_opt)
    return [second.generation, sorted(os.listdir(path)), loaded if rank() == 0 else None,
            expected_second if rank() == 0 else None, expected if rank() == 0 else None]


def test_async_fsdp2_saves_pipeline_and_commit_in_order(ranks, tmp_path):
    generation, listing, loaded, expected_second, expected_first = ranks(2).run(async_distributed_case,
                                                                                 str(tmp_path))[0]
    assert generation == 2 and listing == [METRICS_DIR, "gen-00000001", "gen-00000002"]  # the newest two are kept
    assert_bitwise(expected_second, loaded)
    assert not all(torch.equal(expected_first[k], expected_second[k]) for k in expected_first)


def async_failure_case(path: str) -> str:
    from test_failures import FailingOnRank1

    state = {"model": {"w": torch.ones(8), "v": torch.ones(8)}}  # two tensors: each rank writes one
    handle = bcp.save(FailingOnRank1(path), state, async_save=True)
    try:
        handle.wait()
    except bcp.CheckpointError as exc:
        return type(exc).__name__ + ": " + str(exc)
    return "committed"


def test_async_failure_on_one_rank_raises_on_every_rank(ranks, tmp_path):
    messages = ranks(2).run(async_failure_case, str(tmp_path))
    assert all("No space left on device" in m for m in messages)
    assert not any(os.path.exists(os.path.join(tmp_path, g, "COMMITTED")) for g in os.listdir(tmp_path))


def test_forked_child_does_not_wait_for_the_parents_saves(tmp_path):
    """A forked child (a dataloader worker, say) that exits normally does not wait for its parent's
    async saves. Guards a past defect: the child inherited the parent's pending saves, whose
    background threads exist only in the parent."""
    script = textwrap.dedent(f"""
        import os, sys, torch, bcp
        handle = bcp.save({str(tmp_path)!r}, {{"model": {{"w": torch.arange(4_000_000.0)}}}}, async_save=True)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal interpreter exit in the child: must not wait for the parent's save
        _, status = os.waitpid(pid, 0)
        handle.wait()
        print("child exit", os.waitstatus_to_exitcode(status))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "child exit 0", done.stderr


def test_async_save_snapshots_every_per_rank_value_at_call_time(tmp_path):
    import numpy as np

    tensor, array, buffer = torch.arange(4.0), np.arange(3), bytearray(b"abc")
    nested = {"list": [torch.ones(2)], "inner": {"n": np.zeros(2)}}
    state = {"extra_state": {"t": tensor, "a": array, "b": buffer, "nested": nested}}
    handle = bcp.save(tmp_path, state, async_save=True)
    tensor.add_(100)  # every kind changed in place right after the call returned
    array += 100
    buffer[:] = b"xyz"
    nested["list"][0].add_(100)
    nested["inner"]["n"] += 100
    handle.wait()
    live = {"extra_state": None}
    bcp.load(tmp_path, live)
    loaded = live["extra_state"]
    assert torch.equal(loaded["t"], torch.arange(4.0)) and np.array_equal(loaded["a"], np.arange(3))
    assert bytes(loaded["b"]) == b"abc"
    assert torch.equal(loaded["nested"]["list"][0], torch.ones(2))
    assert np.array_equal(loaded["nested"]["inner"]["n"], np.zeros(2))
