"""The copies between accelerator and host memory, and the writers' background priority.

The accelerator tests run only where one is present (``torch.accelerator``); on a CPU-only machine
they are skipped. What the CPU can check of the same logic runs everywhere: host staging is not
pinned without an accelerator, and an asynchronous save's writer threads run at a lower priority
than the thread that called ``save``, a synchronous save's at the same."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import bcp
from bcp.engine import device_copies
from bcp.engine.load_staging import LoadStagingPool, Staging
from bcp.storage.local import LocalStorage

accelerator = pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")


class PriorityRecordingStorage(LocalStorage):
    """The local file system, noting the niceness of each thread that writes a data file."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.niceness: list[int] = []

    def write_file(self, name, chunks) -> None:
        if "/data/" in name:
            self.niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        super().write_file(name, chunks)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority on this platform")
def test_asynchronous_writers_run_below_the_callers_priority(tmp_path):
    storage = PriorityRecordingStorage(tmp_path)
    state = {"model": {"a": torch.ones(1 << 20), "b": torch.zeros(1 << 20)}}
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    bcp.save(storage, state, io_threads=2)
    assert storage.niceness and set(storage.niceness) == {own}
    storage.niceness.clear()
    bcp.save(storage, state, io_threads=2, async_save=True).wait()
    assert storage.niceness and all(n > own for n in storage.niceness)


def test_without_an_accelerator_host_staging_is_plain_memory():
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    live = torch.zeros(8)
    staging = Staging(LoadStagingPool())
    [tensor] = staging.allocate([(live, (8,), torch.float32)])
    assert not tensor.is_pinned() and not device_copies.is_accelerator(live)


@accelerator
def test_loads_into_accelerator_tensors_stage_through_pinned_memory(tmp_path):
    device = torch.accelerator.current_accelerator()
    saved = {"w": torch.randn(256, 64), "b": torch.randn(64)}
    bcp.save(tmp_path, {"model": saved})
    live = {k: torch.zeros_like(v, device=device) for k, v in saved.items()}
    staging = Staging(LoadStagingPool())
    [tensor] = staging.allocate([(live["w"], (256, 64), torch.float32)])
    assert tensor.is_pinned()
    for transactional in (True, False):
        bcp.load(tmp_path, {"model": live}, transactional=transactional)
        assert all(torch.equal(live[k].cpu(), saved[k]) for k in saved)
        for value in live.values():
            value.zero_()


@accelerator
def test_a_failed_load_leaves_accelerator_tensors_untouched(tmp_path):
    device = torch.accelerator.current_accelerator()
    bcp.save(tmp_path, {"model": {"w": torch.arange(4096.0)}})
    data = sorted(tmp_path.glob("gen-*/data/*.bin"))[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    live = torch.full((4096,), -1.0, device=device)
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.load(tmp_path, {"model": {"w": live}})
    assert torch.all(live == -1).item()


@accelerator
def test_copies_wait_for_the_work_queued_on_the_producing_stream(tmp_path):
    """A save right after a kernel that writes the tensor sees the kernel's result; a load into a
    tensor that queued work still reads sees its old values there and the loaded ones after."""
    device = torch.accelerator.current_accelerator()
    x = torch.zeros(1 << 22, device=device)
    big = torch.randn(2048, 2048, device=device)
    for _ in range(20):  # queued work that keeps the stream busy
        big = big @ big / big.norm()
    x.add_(1.0)  # queued after it: the save must see it
    bcp.save(tmp_path, {"model": {"x": x}}, async_save=True).wait()
    loaded = torch.zeros(1 << 22)
    bcp.load(tmp_path, {"model": {"x": loaded}})
    assert torch.all(loaded == 1.0)
    x.mul_(0.0)
    before = x.clone()  # queued before the load's copies: must read zeros
    bcp.load(tmp_path, {"model": {"x": x}})
    assert torch.all(before == 0.0).item() and torch.all(x == 1.0).item()


@accelerator
def test_an_asynchronous_save_of_accelerator_tensors_holds_the_values_at_the_call(tmp_path):
    device = torch.accelerator.current_accelerator()
    x = torch.arange(1 << 20, dtype=torch.float32, device=device)
    handle = bcp.save(tmp_path, {"model": {"x": x}}, async_save=True)
    x.mul_(-1.0)  # training goes on as soon as save returns
    handle.wait()
    loaded = torch.zeros(1 << 20)
    bcp.load(tmp_path, {"model": {"x": loaded}})
    assert torch.equal(loaded, torch.arange(1 << 20, dtype=torch.float32))
