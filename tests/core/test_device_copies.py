"""The copies between accelerator and host memory on a real accelerator, and the writers' background
priority.

The accelerator tests run only where one is present (``torch.accelerator``); on a CPU-only machine
they are skipped (``scripts/gpu_check.sh`` runs them on a GPU machine). The same pipelines' logic is
checked on the CPU with a simulated accelerator in ``test_chunked_copies.py``. What the CPU checks
here: without an accelerator nothing is pinned and nothing counts as device memory, and an
asynchronous save's writer threads run at a lower priority than the thread that called ``save``,
a synchronous save's at the same."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import bcp
from bcp.engine.chunked_copies import AHEAD, ChunkedCopies, PinnedChunks
from bcp.engine.device_copies import TorchAccelerator
from bcp.engine.load_staging import LoadStagingPool, Staging
from bcp.integration import runtime
from bcp.storage.local import LocalStorage

accelerator = pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")


@pytest.fixture(autouse=True)
def _released():
    """Each test leaves no pinned chunks, staging buffers or writer process behind."""
    yield
    bcp.shutdown()


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


def test_without_an_accelerator_nothing_is_pinned_and_no_tensor_is_device_memory(tmp_path):
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    live = torch.zeros(8)
    staging = Staging(LoadStagingPool(), ChunkedCopies(PinnedChunks(TorchAccelerator())))
    [tensor] = staging.allocate([(live, (8,), torch.float32)])
    assert not tensor.is_pinned() and staging.in_host_memory(live)
    bcp.save(tmp_path, {"model": {"w": torch.randn(1 << 20)}}, async_save=True).wait()
    assert runtime().chunks.held_bytes == 0


def _device() -> torch.device:
    return torch.accelerator.current_accelerator()


def _bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in expected.items():
        assert torch.equal(got[name].cpu(), tensor.cpu()), name


def _device_state() -> dict[str, torch.Tensor]:
    """Large and small tensors, a short last chunk, bf16, and a strided (transposed) one."""
    device = _device()
    return {"w": torch.randn(4096, 4097, device=device),  # a few chunks and a short last one
            "h": torch.randn(3000, 1000, device=device).to(torch.bfloat16),
            "t": torch.randn(1500, 2500, device=device).t(),
            **{f"b{i}": torch.randn(300, device=device) + i for i in range(20)}}


@accelerator
def test_a_sync_save_of_accelerator_tensors_goes_through_a_few_pinned_chunks(tmp_path):
    state = _device_state()
    bcp.save(tmp_path, {"model": state}, io_threads=2)
    assert 0 < runtime().chunks.held_bytes <= 2 * (AHEAD + 1) * runtime().chunks.chunk_bytes
    loaded = {name: torch.empty_like(tensor, device="cpu") for name, tensor in state.items()}
    bcp.load(tmp_path, {"model": loaded})
    _bitwise(loaded, state)


@accelerator
def test_loads_into_accelerator_tensors_stage_in_pageable_memory_and_copy_through_pinned_chunks(tmp_path):
    saved = {name: tensor.cpu() for name, tensor in _device_state().items()}
    bcp.save(tmp_path, {"model": saved})
    live = {name: torch.zeros_like(tensor, device=_device()) for name, tensor in saved.items()}
    staging = Staging(LoadStagingPool(), ChunkedCopies(runtime().chunks))
    [tensor] = staging.allocate([(live["w"], (4096, 4097), torch.float32)])
    assert not tensor.is_pinned() and not staging.in_host_memory(live["w"])
    for transactional in (True, False):
        bcp.load(tmp_path, {"model": live}, transactional=transactional)
        _bitwise(live, saved)
        assert runtime().chunks.held_bytes <= (AHEAD + 1) * runtime().chunks.chunk_bytes
        for value in live.values():
            value.zero_()


@accelerator
def test_the_first_async_save_pins_its_buffer_after_use_and_the_next_copies_straight_into_it(tmp_path):
    state = _device_state()
    first_values = {name: tensor.cpu() for name, tensor in state.items()}
    first = bcp.save(tmp_path, {"model": state}, async_save=True)
    for tensor in state.values():
        tensor.mul_(-1.0)  # training goes on as soon as save returns
    first.wait()
    second = bcp.save(tmp_path, {"model": state}, async_save=True)  # waits for the buffer's pinning
    second.wait()
    assert runtime().buffers.pinned_bytes >= sum(t.numel() * t.element_size() for t in state.values())
    for generation, expected in ((first.generation, first_values), (second.generation, state)):
        loaded = {name: torch.empty_like(tensor, device="cpu") for name, tensor in state.items()}
        bcp.load(tmp_path, {"model": loaded}, generation=generation)
        _bitwise(loaded, expected)


@accelerator
def test_a_failed_load_leaves_accelerator_tensors_untouched(tmp_path):
    bcp.save(tmp_path, {"model": {"w": torch.arange(4096.0)}})
    data = sorted(tmp_path.glob("gen-*/data/*.bin"))[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    live = torch.full((4096,), -1.0, device=_device())
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.load(tmp_path, {"model": {"w": live}})
    assert torch.all(live == -1).item()


@accelerator
def test_copies_wait_for_the_work_queued_on_the_producing_stream(tmp_path):
    """A save right after a kernel that writes the tensor sees the kernel's result, sync or async;
    a load into a tensor that queued work still reads sees its old values there and the loaded
    ones after."""
    device = _device()
    x = torch.zeros(1 << 22, device=device)
    big = torch.randn(2048, 2048, device=device)
    for async_save in (True, False):
        for _ in range(20):  # queued work that keeps the stream busy
            big = big @ big / big.norm()
        x.add_(1.0)  # queued after it: the save must see it
        bcp.save(tmp_path, {"model": {"x": x}}, async_save=async_save).wait()
        loaded = torch.zeros(1 << 22)
        bcp.load(tmp_path, {"model": {"x": loaded}})
        assert torch.all(loaded == x.cpu())
    x.mul_(0.0)
    before = x.clone()  # queued before the load's copies: must read zeros
    bcp.load(tmp_path, {"model": {"x": x}})
    assert torch.all(before == 0.0).item() and torch.all(x == 2.0).item()


@accelerator
def test_an_asynchronous_save_of_accelerator_tensors_holds_the_values_at_the_call(tmp_path):
    device = _device()
    x = torch.arange(1 << 20, dtype=torch.float32, device=device)
    handle = bcp.save(tmp_path, {"model": {"x": x}}, async_save=True)
    x.mul_(-1.0)  # training goes on as soon as save returns
    handle.wait()
    loaded = torch.zeros(1 << 20)
    bcp.load(tmp_path, {"model": {"x": loaded}})
    assert torch.equal(loaded, torch.arange(1 << 20, dtype=torch.float32))
