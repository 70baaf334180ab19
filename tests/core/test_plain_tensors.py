"""Tensors held outside modules and optimizers (a dict EMA, a list of buffers, a bare tensor, the
tensors inside any value): each is a tensor of the checkpoint, loaded into the live tensor at the
same place, written once where ranks hold the same bytes and per rank where they differ."""

from __future__ import annotations

import logging
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

import bcp
from bcp.integration import reset_runtime
from bcp.tools import open_checkpoint, read_tensor
from models import assert_bitwise, build, model_state, rank, read_manifest, train

FIXTURES = Path(__file__).parent.parent / "fixtures"
Stats = namedtuple("Stats", "mean var count")


def user_state(seed: int) -> dict:
    """What a custom training loop holds beside its model: an EMA dict, a list of buffers, a bare
    tensor, running statistics in a namedtuple, a step counter."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": nn.Linear(4, 3),
        "ema": {"weight": torch.randn(3, 4, generator=g), "bias": torch.randn(3, generator=g), "decay": 0.99},
        "buffers": [torch.randn(5, generator=g), torch.randint(0, 9, (2, 2), generator=g)],
        "scale": torch.randn((), generator=g),
        "stats": Stats(torch.randn(2, generator=g), torch.rand(2, generator=g), seed),
        "step": seed,
    }


def test_tensors_in_a_plain_dict_a_list_and_at_the_top_level_load_into_the_referenced_tensors(tmp_path):
    saved = user_state(1)
    bcp.save(tmp_path, saved)
    live = user_state(2)
    ema, ema_weight, buffers, first_buffer, scale = live["ema"], live["ema"]["weight"], live["buffers"], \
        live["buffers"][0], live["scale"]

    bcp.load(tmp_path, live)

    assert live["ema"] is ema and ema["weight"] is ema_weight and torch.equal(ema_weight, saved["ema"]["weight"])
    assert torch.equal(ema["bias"], saved["ema"]["bias"]) and ema["decay"] == 0.99
    assert live["buffers"] is buffers and buffers[0] is first_buffer
    assert_bitwise(dict(enumerate(saved["buffers"])), dict(enumerate(buffers)))
    assert live["scale"] is scale and torch.equal(scale, saved["scale"])
    assert type(live["stats"]) is Stats and torch.equal(live["stats"].var, saved["stats"].var)
    assert live["stats"].count == 1 and live["step"] == 1


def test_every_tensor_is_a_tensor_entry_and_values_keep_only_the_other_leaves(tmp_path):
    saved = user_state(1)
    bcp.save(tmp_path, saved)
    manifest = read_manifest(tmp_path)
    assert sorted(manifest.tensors) == ["buffers/0", "buffers/1", "ema/bias", "ema/weight", "model/bias",
                                        "model/weight", "scale", "stats/0", "stats/1"]
    assert sorted(manifest.objects) == ["buffers", "ema", "stats", "step"]
    value_bytes = sum(where.nbytes for entry in manifest.objects.values() for where, _ in entry.records)
    assert value_bytes < 400  # the records hold references, not the tensors' bytes
    assert torch.equal(read_tensor(tmp_path, "ema/weight"), saved["ema"]["weight"])
    assert torch.equal(read_tensor(tmp_path, "buffers/1", (1, slice(None))), saved["buffers"][1][1])


def test_a_value_with_nothing_live_to_load_into_gets_its_tensors_placed(tmp_path):
    saved = user_state(1)
    bcp.save(tmp_path, saved)
    live = {"ema": None, "buffers": None, "scale": None, "stats": None}
    bcp.load(tmp_path, live, strict=False)
    assert torch.equal(live["ema"]["weight"], saved["ema"]["weight"]) and live["ema"]["decay"] == 0.99
    assert_bitwise(dict(enumerate(saved["buffers"])), dict(enumerate(live["buffers"])))
    assert torch.equal(live["scale"], saved["scale"])
    assert tuple(live["stats"])[2] == 1 and torch.equal(live["stats"][0], saved["stats"].mean)
    assert open_checkpoint(tmp_path).read_object("ema")["weight"].equal(saved["ema"]["weight"])


def test_a_live_tensor_of_another_shape_or_dtype_is_a_mismatch_and_nothing_is_loaded(tmp_path):
    bcp.save(tmp_path, user_state(1))
    live = user_state(2)
    live["ema"]["bias"] = torch.zeros(4)
    before = live["ema"]["weight"].clone()
    with pytest.raises(bcp.MismatchError, match="ema/bias"):
        bcp.load(tmp_path, live)
    assert torch.equal(live["ema"]["weight"], before)  # transactional: nothing placed
    live["ema"]["bias"] = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(bcp.MismatchError, match="float64"):
        bcp.load(tmp_path, live)
    bcp.load(tmp_path, live, cast_dtype=True)
    assert live["ema"]["bias"].dtype == torch.float64


def test_an_asynchronous_save_stores_the_tensors_as_they_were_when_it_returned(tmp_path):
    state = user_state(1)
    expected = {"ema/weight": state["ema"]["weight"].clone(), "scale": state["scale"].clone()}
    handle = bcp.save(tmp_path, state, async_save=True)
    state["ema"]["weight"].add_(1)
    state["scale"].add_(1)
    state["ema"]["decay"] = 0.5
    handle.wait()
    checkpoint = open_checkpoint(tmp_path)
    assert_bitwise(expected, {name: checkpoint.read(name) for name in expected})
    assert checkpoint.read_object("ema")["decay"] == 0.99


def test_checkpoints_whose_values_held_their_tensors_load_in_place():
    from fixture_state import tensors_in_values_state

    expected = tensors_in_values_state()
    live = {"model": {"weight": torch.zeros(3, 4)},
            "ema": {"weight": torch.zeros(3, 4), "decay": 0.0, "steps": [torch.tensor(0), ""]},
            "rng": torch.zeros(6, dtype=torch.uint8), "extra_state": None}
    ema, weight, rng = live["ema"], live["ema"]["weight"], live["rng"]
    bcp.load(FIXTURES / "format-v1-tensors-in-values", live, metrics_log=False)
    assert live["ema"] is ema and ema["weight"] is weight and torch.equal(weight, expected["ema"]["weight"])
    assert ema["decay"] == 0.999 and torch.equal(ema["steps"][0], torch.tensor(5)) and ema["steps"][1] == "x"
    assert live["rng"] is rng and torch.equal(rng, expected["rng"])
    assert live["extra_state"] == {"step": 9}


def save_with_ddp_ema(path: str) -> None:
    model, optimizer = build("ddp", seed=1)
    train(model, optimizer, range(2))
    ema = {name: value.detach().clone() * 0.5 for name, value in model.module.state_dict().items()}
    rng = torch.full((16,), rank(), dtype=torch.uint8)  # differs across ranks: each rank's own
    bcp.save(path, {"model": model, "optimizer": optimizer, "ema": ema, "rng": rng, "step": 2})


def load_with_ema(path: str) -> dict:
    model, optimizer = build("plain" if not torch.distributed.is_initialized() else "ddp", seed=5)
    ema = {name: torch.zeros_like(value) for name, value in model_state(model).items()}
    rng = torch.zeros(16, dtype=torch.uint8)
    state = {"model": model, "optimizer": optimizer, "ema": ema, "rng": rng, "step": 0}
    result = bcp.load(path, state)
    return {"ema": {name: value.clone() for name, value in ema.items()}, "same_dict": state["ema"] is ema,
            "rng": rng.clone(), "duplicated": result.duplicated, "dropped": result.dropped}


def test_a_ddp_replicated_dict_ema_is_written_once_and_loads_on_one_and_three_ranks(ranks, tmp_path, caplog):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_with_ddp_ema, path)
    manifest = read_manifest(path)
    ema = {name: entry for name, entry in manifest.tensors.items() if name.startswith("ema/")}
    model = {name: entry for name, entry in manifest.tensors.items() if name.startswith("model/")}
    assert len(ema) == len(model) and all(len(entry.shards) == 1 for entry in ema.values())  # once, not per rank
    ema_bytes = sum(s.bytes.nbytes for entry in ema.values() for s in entry.shards)
    assert ema_bytes == sum(s.bytes.nbytes for entry in model.values() for s in entry.shards)
    assert len(manifest.objects["rng"].records) == 2 and manifest.objects["rng"].ranks == [0, 1]
    saved_ema = {name.removeprefix("ema/"): open_checkpoint(path).read(name) for name in ema}

    with caplog.at_level(logging.WARNING, logger="bcp"):
        one = load_with_ema(path)
    assert one["same_dict"] and one["dropped"] == {"rng": [1]} and "rng (ranks [1])" in caplog.text
    assert_bitwise(saved_ema, one["ema"])
    assert torch.equal(one["rng"], torch.zeros(16, dtype=torch.uint8))  # rank 0's own
    three = ranks(3).run(load_with_ema, path)
    for r, loaded in enumerate(three):
        assert loaded["same_dict"]
        assert_bitwise(saved_ema, loaded["ema"])
        assert torch.equal(loaded["rng"], torch.full((16,), r if r < 2 else 0, dtype=torch.uint8))
    assert three[0]["duplicated"] == {"rng": [2]}


def save_twice_with_kinds_changing(path: str) -> None:
    """A tensor equal on both ranks at the first save, different at the second (the cached plan
    must not be reused for it)."""
    shared = torch.arange(4.0)
    bcp.save(path, {"t": shared})
    shared.add_(rank())
    bcp.save(path, {"t": shared})


def load_t(path: str) -> torch.Tensor:
    t = torch.zeros(4)
    bcp.load(path, {"t": t})
    return t


def test_a_tensor_that_stops_being_the_same_on_every_rank_is_saved_per_rank(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_twice_with_kinds_changing, path)
    manifest = read_manifest(path)
    assert "t" not in manifest.tensors and manifest.objects["t"].ranks == [0, 1]
    loaded = ranks(2).run(load_t, path)
    assert torch.equal(loaded[0], torch.arange(4.0)) and torch.equal(loaded[1], torch.arange(4.0) + 1)


def save_a_large_replicated_tensor(path: str) -> None:
    from bcp.planning import save_plan

    save_plan.SPLIT_BYTES = 4 << 20  # a 24 MiB replicated tensor is "very large": each rank writes a part
    try:
        g = torch.Generator().manual_seed(0)
        bcp.save(path, {"ema": {"big": torch.randn(3000, 2048, generator=g)}})
    finally:
        save_plan.SPLIT_BYTES = 256 << 20


def test_a_large_replicated_tensor_is_written_in_parts_with_the_checksums_computed_once(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_a_large_replicated_tensor, path)
    entry = read_manifest(path).tensors["ema/big"]
    assert [s.box.offsets[0] for s in entry.shards] == [0, 1536]  # cut on a checksum chunk boundary
    assert {s.bytes.file for s in entry.shards} == {0, 1}  # one part by each rank
    g = torch.Generator().manual_seed(0)
    assert torch.equal(read_tensor(path, "ema/big"), torch.randn(3000, 2048, generator=g))  # every chunk verified


@pytest.fixture
def device():
    from simulated_accelerator import SimulatedAccelerator

    accelerator = SimulatedAccelerator()
    reset_runtime(accelerator, chunk_bytes=1 << 20)
    yield accelerator
    bcp.shutdown()
    accelerator.close()


def test_plain_tensors_in_accelerator_memory_are_checksummed_and_written_through_the_pinned_chunks(tmp_path, device):
    from simulated_accelerator import COPIED, TO_HOST

    ema = {"w": torch.randn(4 << 20), "b": torch.randn(1000)}  # 16 MiB and 4 KB "on the device"
    device.adopt(*ema.values())
    expected = {name: value.clone() for name, value in ema.items()}
    bcp.save(tmp_path, {"ema": ema}, io_threads=1)
    to_host = [e.nbytes for e in device.of(COPIED, TO_HOST)]
    assert max(to_host) == 1 << 20  # chunk by chunk, never the tensor at once
    assert sum(to_host) == 2 * (16 << 20) + 2 * 4000  # once for the checksums, once for the write
    live = {"w": torch.zeros(4 << 20), "b": torch.zeros(1000)}
    device.adopt(*live.values())
    bcp.load(tmp_path, {"ema": live})
    assert_bitwise(expected, live)
