"""A load that fails (a damaged byte found by its checksum, on any rank) leaves the live state
exactly as it was on every rank, so a training loop can catch the error and go on;
``transactional=False`` trades that for placing bytes as they arrive, and then the error is all
that protects the caller.

A transactional load places its staged values by exchanging memory with the live tensor where the
live tensor is the whole of a storage bcp's allocator made, and copies everywhere else; its staging
buffers are reused by the next load.

Guards a past defect: a load that failed its checksum left the corrupted bytes (or a mix of old and
new) in the live tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import bcp
from bcp.api.runtime import runtime
from bcp.storage.local import LocalStorage


def _flip_a_byte(path, rank: int = 0) -> None:
    data = sorted(path.glob(f"gen-*/data/{rank:05d}-*.bin"))[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 + 3] ^= 0xFF  # one byte in the middle of the data file
    data.write_bytes(bytes(raw))


def _saved(tmp_path):
    saved = {"a": torch.arange(4096.0), "b": torch.arange(4096.0) * 2}
    bcp.save(tmp_path, {"model": saved})
    return saved


def test_a_failed_load_leaves_every_live_tensor_as_it_was(tmp_path):
    _saved(tmp_path)
    _flip_a_byte(tmp_path)
    live = {"a": torch.full((4096,), -1.0), "b": torch.full((4096,), -2.0)}
    before = {k: v.clone() for k, v in live.items()}
    with pytest.raises(bcp.CorruptCheckpointError, match="checksum mismatch"):
        bcp.load(tmp_path, {"model": live})
    assert all(torch.equal(live[k], before[k]) for k in live)  # neither the damaged nor the good tensor moved


def test_without_transactions_the_live_state_may_be_partly_overwritten(tmp_path):
    _saved(tmp_path)
    _flip_a_byte(tmp_path)
    live = {"a": torch.full((4096,), -1.0), "b": torch.full((4096,), -2.0)}
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.load(tmp_path, {"model": live}, transactional=False)
    assert not (torch.all(live["a"] == -1) and torch.all(live["b"] == -2))


def test_a_flipped_byte_is_found_when_the_staging_buffers_are_reused(tmp_path):
    """The second load reads into the buffers the first one left (holding the good values): the
    damaged byte is still found and nothing is placed."""
    saved = _saved(tmp_path)
    live = {"a": torch.zeros(4096), "b": torch.zeros(4096)}
    bcp.load(tmp_path, {"model": live})
    assert all(torch.equal(live[k], saved[k]) for k in saved)
    live["a"].fill_(-1.0), live["b"].fill_(-2.0)
    _flip_a_byte(tmp_path)
    with pytest.raises(bcp.CorruptCheckpointError, match="checksum mismatch"):
        bcp.load(tmp_path, {"model": live})
    assert torch.all(live["a"] == -1) and torch.all(live["b"] == -2)


def failing_on_rank_1(path: str) -> tuple[str, bool]:
    rank = dist.get_rank()
    mine = torch.arange(8192.0) + 1000 * rank
    bcp.save(path, {"model": {f"w{rank}": mine}})  # each rank's tensor in its own data file
    dist.barrier()
    if rank == 0:
        from pathlib import Path
        _flip_a_byte(Path(path), rank=1)
    dist.barrier()
    live = torch.full((8192,), -1.0)
    try:
        bcp.load(path, {"model": {f"w{rank}": live}})
        outcome = "loaded"
    except bcp.CheckpointError as exc:
        outcome = type(exc).__name__
    return outcome, bool(torch.all(live == -1))


def test_a_load_failing_on_one_rank_leaves_every_rank_untouched(ranks, tmp_path):
    """Rank 0 reads and verifies its own bytes without fault; rank 1 finds a damaged byte: both
    raise, and neither placed anything."""
    assert ranks(2).run(failing_on_rank_1, str(tmp_path)) == [("CorruptCheckpointError", True)] * 2


def test_a_whole_tensor_gets_the_loaded_memory_and_keeps_its_identity(tmp_path):
    """The memory exchange: the parameter object, its storage object and every view of it stay the
    ones training holds (an optimizer's references stay valid); the values are the saved ones."""
    model = torch.nn.Linear(64, 32)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    bcp.save(tmp_path, {"model": model})
    live = torch.nn.Linear(64, 32)
    weight, storage, row = live.weight, live.weight.untyped_storage(), live.weight[3]
    address = weight.data_ptr()
    bcp.load(tmp_path, {"model": live})
    assert live.weight is weight and weight.untyped_storage()._cdata == storage._cdata
    assert weight.data_ptr() != address  # exchanged, not copied
    assert torch.equal(weight, saved["weight"]) and torch.equal(live.bias, saved["bias"])
    assert torch.equal(row, saved["weight"][3])  # a view taken before the load sees the loaded values


def test_a_flat_buffer_whose_views_are_loaded_gets_the_loaded_memory(tmp_path):
    """Views of one flat buffer (as FSDP's flat parameters and Megatron's buffers are) covering most
    of it: the buffer is staged whole and exchanged; the bytes no view covers keep their values."""
    a, b = torch.arange(6.0), torch.arange(4.0) + 10
    bcp.save(tmp_path, {"model": {"a": a, "b": b}})
    flat = torch.full((12,), -7.0)
    live = {"a": flat[:6], "b": flat[8:]}  # elements 6 and 7 are no tensor's
    address = flat.data_ptr()
    bcp.load(tmp_path, {"model": live})
    assert flat.data_ptr() != address
    assert flat.tolist() == a.tolist() + [-7.0, -7.0] + b.tolist()


def test_tied_sparse_and_borrowed_memory_is_copied_into(tmp_path):
    """Live tensors whose memory is not exchanged keep it: a tensor loaded twice (tied weights), a
    view covering little of its buffer, memory borrowed from numpy."""
    c = torch.arange(3.0) + 20
    bcp.save(tmp_path, {"model": {"c": c, "d": c.clone(), "e": torch.arange(2.0)}})
    tied, big, array = torch.zeros(3), torch.zeros(100), np.zeros(3, dtype=np.float32)
    addresses = tied.data_ptr(), big.data_ptr()
    bcp.load(tmp_path, {"model": {"c": tied, "d": tied, "e": big[10:12]}})
    assert (tied.data_ptr(), big.data_ptr()) == addresses
    assert torch.equal(tied, c) and big[10:12].tolist() == [0.0, 1.0] and big.sum() == 1.0
    bcp.load(tmp_path, {"model": {"c": torch.from_numpy(array)}}, strict=False)
    assert array.tolist() == c.tolist()  # the numpy array sees the loaded values: its memory was written


def test_autograd_sees_a_load_as_an_in_place_change(tmp_path):
    """A value saved for backward and then loaded into is caught by autograd, as a copy would be."""
    bcp.save(tmp_path, {"model": {"w": torch.ones(4)}})
    w = torch.zeros(4, requires_grad=True)
    with torch.no_grad():
        held = w.detach()
    y = (w * w).sum()  # saves w for backward
    bcp.load(tmp_path, {"model": {"w": held}})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_repeated_loads_reuse_one_set_of_staging_buffers(tmp_path):
    """Host memory stays flat: each load stages into the buffers the previous one left, and the
    pool holds one load's worth."""
    saved = {"w": torch.randn(1000, 64), "v": torch.randn(333)}
    bcp.save(tmp_path, {"model": saved})
    live = {k: torch.zeros_like(v) for k, v in saved.items()}
    addresses = set()
    for _ in range(4):
        bcp.load(tmp_path, {"model": live})
        addresses.add(live["w"].data_ptr())
        assert all(torch.equal(live[k], saved[k]) for k in saved)
        assert runtime().load_staging.held_bytes == sum(v.numel() * 4 for v in saved.values())
    assert len(addresses) == 2  # the live memory and one staging buffer, taking turns


class _PoolWatch(LocalStorage):
    """Local files; notes what the load staging pool holds whenever a tensor's bytes are read."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.held_while_reading: list[int] = []

    def read_into_many(self, name, offset, views):
        self.held_while_reading.append(runtime().load_staging.held_bytes)
        return super().read_into_many(name, offset, views)


def test_a_load_of_another_layout_does_not_hold_the_previous_layouts_buffers(tmp_path):
    """Host memory of a load is the live state and one set of staging buffers: the buffers a load
    of another layout cannot reuse are freed once its own are allocated, before it reads.

    Guards a past defect: the pool kept the previous load's buffers until the next load of another
    layout ended, so that load peaked at a whole staging set more (a 2 GB state loaded after a 1 GB
    one held 1 GB of idle buffers beside its 2 GB of staging)."""
    small, large = {"w": torch.randn(1000, 64)}, {"w": torch.randn(3000, 64)}
    bcp.save(tmp_path / "small", {"model": small})
    bcp.save(tmp_path / "large", {"model": large})
    live_small, live_large = {"w": torch.zeros(1000, 64)}, {"w": torch.zeros(3000, 64)}
    bcp.load(tmp_path / "small", {"model": live_small})
    assert runtime().load_staging.held_bytes == 1000 * 64 * 4  # kept for the next load
    watch = _PoolWatch(tmp_path / "large")
    bcp.load(watch, {"model": live_large})
    assert torch.equal(live_large["w"], large["w"])
    assert watch.held_while_reading and set(watch.held_while_reading) == {0}
    assert runtime().load_staging.held_bytes == 3000 * 64 * 4  # the large layout's, for its next load
    bcp.load(tmp_path / "small", {"model": live_small})
    assert torch.equal(live_small["w"], small["w"])


def test_a_load_that_stages_nothing_leaves_the_staging_buffers_to_the_next_load(tmp_path):
    """``transactional=False`` reads straight into the live tensors; the staging buffers the last
    transactional load left still serve the next one, which touches no fresh memory.

    Guards a past defect: a non-transactional load emptied the pool, so the next transactional
    load of the same state allocated (and page-faulted) a whole fresh staging set."""
    saved = {"w": torch.randn(1000, 64)}
    bcp.save(tmp_path, {"model": saved})
    live = {"w": torch.zeros(1000, 64)}
    bcp.load(tmp_path, {"model": live})
    addresses = {live["w"].data_ptr()}
    bcp.load(tmp_path, {"model": live}, transactional=False)
    assert runtime().load_staging.held_bytes == 1000 * 64 * 4
    for _ in range(2):
        live["w"].zero_()
        bcp.load(tmp_path, {"model": live})
        assert torch.equal(live["w"], saved["w"])
        addresses.add(live["w"].data_ptr())
    assert len(addresses) == 2  # the live memory and the one staging buffer, taking turns
