"""Saves and loads of tensors in accelerator memory, through the pinned chunks, checked on the CPU:
a simulated accelerator (``simulated_accelerator``: host copies on a thread standing in for the
device's copy engine) takes the place of torch's, so the pipelines run here with their real order,
overlap and memory. What they must show:

- a synchronous save writes device tensors chunk by chunk: the copies of the next chunks are queued
  before the current one is written, and host memory holds a few chunks, not the state;
- the first asynchronous save copies through the chunks and page-locks its staging buffer on a
  thread of its own, not on the caller's; the saves after it copy straight into that buffer;
- a load into device tensors stages in pageable memory and copies through the chunks; one that is
  not transactional copies each piece to the device while the reads after it go on;
- every byte arrives: loads are bitwise, whatever the storage does with the chunks it is given.
"""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

import bcp
from bcp.engine import writer
from bcp.engine.chunked_copies import AHEAD
from bcp.integration import reset_runtime, runtime
from bcp.storage.base import streamed_from
from bcp.storage.local import LocalStorage
from simulated_accelerator import COPIED, PINNED, QUEUED, REGISTERED, TO_DEVICE, TO_HOST, SimulatedAccelerator

CHUNK = 1 << 20  # the checksum chunk: the smallest pinned chunk a save can use
FLOATS = CHUNK // 4


@pytest.fixture
def device():
    accelerator = SimulatedAccelerator()
    reset_runtime(accelerator, chunk_bytes=CHUNK)
    yield accelerator
    bcp.shutdown()
    accelerator.close()


def on_device(device: SimulatedAccelerator, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    device.adopt(*tensors.values())
    return tensors


def host_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in state.items()}


def loaded(path, like: dict[str, torch.Tensor], **options) -> dict[str, torch.Tensor]:
    out = {name: torch.zeros_like(tensor) for name, tensor in like.items()}
    bcp.load(path, {"model": out}, **options)
    return out


def assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


class NotingStorage(LocalStorage):
    """The local file system, adding to the accelerator's record when each chunk of a data file is
    handed to it ("write") and when it asks for the next ("written")."""

    def __init__(self, root, device: SimulatedAccelerator) -> None:
        super().__init__(root)
        self.device = device

    def write_file(self, name, chunks) -> None:
        super().write_file(name, self._noted(chunks) if "/data/" in name else chunks)

    def _noted(self, chunks):
        for chunk in chunks:
            self.device.note("write", nbytes=chunk.nbytes)
            yield chunk
            self.device.note("written", nbytes=chunk.nbytes)


def test_a_sync_save_queues_the_next_chunks_from_the_device_before_it_writes_the_current_one(tmp_path, device):
    state = on_device(device, {"w": torch.randn(8 * FLOATS)})
    storage = NotingStorage(tmp_path, device)
    bcp.save(storage, {"model": state}, io_threads=1)
    kinds = [(e.kind, e.detail) for e in device.events if e.nbytes == CHUNK]
    copies = [i for i, kind in enumerate(kinds) if kind == (QUEUED, TO_HOST)]
    writes = [i for i, kind in enumerate(kinds) if kind == ("write", "")]
    written = [i for i, kind in enumerate(kinds) if kind == ("written", "")]
    assert len(copies) == len(writes) == len(written) == 8
    for k in range(8):
        assert copies[k] < writes[k]
        if k + AHEAD < 8:  # the chunks after it were on their way while it was written
            assert copies[k + AHEAD] < writes[k]
        if k + AHEAD + 1 < 8:  # and no more than that: a chunk's memory is reused once written
            assert copies[k + AHEAD + 1] > written[k]
    assert_bitwise(loaded(tmp_path, state), host_copy(state))


def test_a_sync_save_holds_a_few_chunks_of_pinned_memory_however_large_the_state(tmp_path, device):
    state = on_device(device, {f"w{i}": torch.randn(6 * FLOATS + 100 * i) for i in range(4)})
    bcp.save(tmp_path, {"model": state}, io_threads=2)
    pinned = sum(e.nbytes for e in device.of(PINNED))
    assert pinned <= 2 * (AHEAD + 1) * CHUNK < sum(t.numel() * 4 for t in state.values()) / 2
    assert runtime().chunks.held_bytes == pinned
    bcp.save(tmp_path, {"model": state}, io_threads=2)
    assert sum(e.nbytes for e in device.of(PINNED)) == pinned  # the next save reuses them
    assert_bitwise(loaded(tmp_path, state), host_copy(state))


def test_small_device_tensors_and_short_last_chunks_survive_a_storage_that_gathers_small_writes(tmp_path, device):
    """The local file system gathers writes under 1 MiB into one call: a chunk's memory reused as
    soon as the next was asked for would have been overwritten before it reached the file."""
    state = on_device(device, {f"bias{i}": torch.randn(256) + i for i in range(40)})
    state["w"] = on_device(device, {"w": torch.randn(2 * FLOATS + 1000)})["w"]
    assert streamed_from(LocalStorage(tmp_path)) == CHUNK
    bcp.save(tmp_path, {"model": state}, io_threads=1)
    assert_bitwise(loaded(tmp_path, state), host_copy(state))


class FillingDisk(LocalStorage):
    """The local file system on a disk that is full after ``chunks`` chunks of data files: the next
    write fails with ENOSPC, as a full disk does (a test cannot fill this machine's disk)."""

    def __init__(self, root, chunks: int) -> None:
        super().__init__(root)
        self.left = chunks

    def write_file(self, name, chunks) -> None:
        super().write_file(name, self._until_full(chunks) if "/data/" in name else chunks)

    def _until_full(self, chunks):
        for chunk in chunks:
            if self.left == 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.left -= 1
            yield chunk


def test_a_save_that_fails_mid_tensor_gives_every_chunk_back(tmp_path, device):
    state = on_device(device, {"w": torch.randn(6 * FLOATS)})
    with pytest.raises(bcp.CheckpointError, match="No space left"):
        bcp.save(FillingDisk(tmp_path, chunks=2), {"model": state}, io_threads=1)
    pinned = len(device.of(PINNED))
    assert 0 < pinned <= AHEAD + 1
    bcp.save(tmp_path, {"model": state}, io_threads=1)
    assert len(device.of(PINNED)) == pinned  # the failed save's chunks, all back in the pool
    assert_bitwise(loaded(tmp_path, state), host_copy(state))


def test_a_storage_that_keeps_every_chunk_gets_chunks_of_their_own(device):
    state = on_device(device, {"w": torch.randn(3 * FLOATS), "b": torch.randn(10)})
    path = "memory://chunked-copies/ckpt"
    bcp.save(path, {"model": state}, io_threads=1)
    assert_bitwise(loaded(path, state), host_copy(state))


def test_strided_device_tensors_are_saved_and_loaded_chunk_by_chunk(tmp_path, device):
    base = torch.randn(700, 900)  # a chunk ends inside a row
    device.adopt(base)
    bcp.save(tmp_path, {"model": {"t": base.t()}})
    into = torch.zeros(700, 900)
    device.adopt(into)
    bcp.load(tmp_path, {"model": {"t": into.t()}})
    assert torch.equal(into, base)
    copies = device.of(QUEUED, TO_HOST) + device.of(QUEUED, TO_DEVICE)
    assert len(copies) > 2 * 3 and all(e.nbytes <= CHUNK for e in copies)  # 3 chunks, of several runs each


def test_the_first_async_save_copies_through_the_chunks_and_pins_its_buffer_off_the_callers_thread(tmp_path, device):
    state = on_device(device, {"w": torch.randn(3 * FLOATS), "v": torch.randn(2 * FLOATS)})
    first_values = host_copy(state)
    caller = threading.current_thread().name
    first = bcp.save(tmp_path, {"model": state}, async_save=True)
    at_return = list(device.events)
    assert not [e for e in at_return if e.kind == REGISTERED]
    assert sum(e.nbytes for e in at_return if e.kind == PINNED) <= (AHEAD + 1) * CHUNK
    device_copies = [e for e in at_return if e.kind == QUEUED and e.detail == TO_HOST]
    assert len(device_copies) == 5 and all(e.nbytes == CHUNK and e.thread == caller for e in device_copies)
    first.wait()
    for tensor in state.values():
        tensor.mul_(-1.0)  # training went on
    second_start = len(device.events)
    second = bcp.save(tmp_path, {"model": state}, async_save=True)
    second.wait()
    [registered] = device.of(REGISTERED)
    assert registered.thread.startswith("bcp-pin") and registered.nbytes >= 5 * CHUNK
    assert device.events.index(registered) < second_start  # the second save waited for it
    assert runtime().buffers.pinned_bytes == registered.nbytes
    straight = [e.nbytes for e in device.events[second_start:] if e.kind == QUEUED and e.detail == TO_HOST]
    assert sorted(straight) == [2 * CHUNK, 3 * CHUNK]  # each tensor in one copy, into the pinned buffer
    assert_bitwise(loaded(tmp_path, state, generation=first.generation), first_values)
    assert_bitwise(loaded(tmp_path, state), host_copy(state))


def test_a_load_into_device_memory_stages_in_pageable_memory_and_copies_through_the_chunks(tmp_path, device):
    saved = {"w": torch.randn(5 * FLOATS), "b": torch.randn(10)}
    bcp.save(tmp_path, {"model": saved})
    live = on_device(device, {name: torch.zeros_like(tensor) for name, tensor in saved.items()})
    bcp.load(tmp_path, {"model": live})
    assert_bitwise(live, saved)
    assert sum(e.nbytes for e in device.of(PINNED)) <= (AHEAD + 1) * CHUNK
    assert sorted(e.nbytes for e in device.of(COPIED, TO_DEVICE)) == [40] + [CHUNK] * 5


def test_a_failed_load_leaves_device_tensors_untouched_and_copies_nothing(tmp_path, device):
    bcp.save(tmp_path, {"model": {"w": torch.arange(4096.0)}})
    data = sorted(tmp_path.glob("gen-*/data/*.bin"))[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    live = on_device(device, {"w": torch.full((4096,), -1.0)})
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.load(tmp_path, {"model": live})
    assert torch.all(live["w"] == -1) and not device.of(QUEUED, TO_DEVICE)


class GatedStorage(LocalStorage):
    """The local file system, holding back every read of a data file after the first until the
    accelerator has been asked for a copy to the device, for 10 s at most; notes which came first."""

    def __init__(self, root, device: SimulatedAccelerator) -> None:
        super().__init__(root)
        self.device = device
        self.data_reads = 0

    def read_into_many(self, name, offset, dests) -> None:
        if "/data/" in name:
            self.data_reads += 1
            if self.data_reads > 1:
                deadline = time.monotonic() + 10
                while not self.device.of(QUEUED, TO_DEVICE) and time.monotonic() < deadline:
                    time.sleep(0.005)
                self.device.note("gate", "copy first" if self.device.of(QUEUED, TO_DEVICE) else "timed out")
        super().read_into_many(name, offset, dests)


def test_a_load_that_is_not_transactional_copies_each_piece_to_the_device_while_later_reads_go_on(
        tmp_path, device, monkeypatch):
    monkeypatch.setattr(writer, "MIN_BYTES_PER_FILE", CHUNK)  # two data files out of a small state
    saved = {"a": torch.randn(2 * FLOATS), "b": torch.randn(2 * FLOATS)}
    bcp.save(tmp_path, {"model": saved}, io_threads=2)
    assert len(list(tmp_path.glob("gen-*/data/*.bin"))) == 2
    live = on_device(device, {name: torch.zeros_like(tensor) for name, tensor in saved.items()})
    storage = GatedStorage(tmp_path, device)
    bcp.load(storage, {"model": live}, transactional=False, io_threads=1)
    assert [e.detail for e in device.of("gate")] == ["copy first"]
    assert_bitwise(live, saved)
