"""Save and load without a process group: round trips, generations, roles, and every kind of bad
input, each with a clear ``bcp`` error naming the checkpoint and the entry."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from crc32c import crc32c
from torch import nn

import bcp
import bcp.integration
from bcp.engine.location import METRICS_DIR
from models import MLP, assert_bitwise, build, full_state, read_manifest, train


def trained(seed: int = 1):
    model, optimizer = build("plain", seed)
    train(model, optimizer, range(2))
    return model, optimizer


def data_files(path) -> list[str]:
    gen = sorted(p for p in os.listdir(path) if p.startswith("gen-"))[-1]
    folder = os.path.join(path, gen, "data")
    return [os.path.join(folder, f) for f in sorted(os.listdir(folder))]


def test_round_trip_model_optimizer_and_extra_state(tmp_path):
    model, optimizer = trained()
    extra = {"step": 7, "rng": torch.get_rng_state()}
    bcp.save(tmp_path, {"model": model, "optimizer": optimizer, "extra_state": extra})
    fresh, fresh_opt = build("plain", seed=2, lr=0.5)
    state = {"model": fresh, "optimizer": fresh_opt, "extra_state": None}
    result = bcp.load(tmp_path, state)
    assert_bitwise(full_state(model, optimizer), full_state(fresh, fresh_opt))
    assert fresh_opt.param_groups[0]["lr"] == 1e-2 and state["extra_state"]["step"] == 7
    assert torch.equal(state["extra_state"]["rng"], extra["rng"])
    assert result.generation == 1 and result.saved_world_size == 1 and result.saved_framework == "plain"
    assert result.stats.bytes > 0 and {"metadata", "plan", "read", "apply"} <= result.stats.seconds.keys()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.float64, torch.int8, torch.uint8, torch.complex64])
def test_dtypes_zero_dim_empty_and_non_contiguous(tmp_path, dtype):
    base = (torch.arange(60) % 7).to(dtype)
    sd = {
        "matrix": base.reshape(6, 10).clone(),
        "scalar": base[3].clone(),
        "empty": base[:0].reshape(0, 4).clone(),
        "transposed": base.reshape(6, 10).t(),          # non-contiguous
        "strided": base.reshape(6, 10)[::2, 1::3],      # non-contiguous slice
    }
    bcp.save(tmp_path, {"model": sd})
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    target["transposed"] = torch.zeros(6, 10, dtype=dtype).t()  # load into a non-contiguous view
    bcp.load(tmp_path, {"model": target})
    for key, value in sd.items():
        assert target[key].dtype == dtype and torch.equal(target[key], value), key


def test_optimizer_that_never_stepped_loads_without_changing_parameters(tmp_path):
    model, optimizer = trained()
    bcp.save(tmp_path, {"optimizer": optimizer, "model": model})
    fresh, fresh_opt = build("plain", seed=3)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    bcp.load(tmp_path, {"model": fresh, "optimizer": fresh_opt}, strict=False)
    bcp.load(tmp_path, {"model": fresh, "optimizer": fresh_opt})
    assert fresh_opt.state[fresh.fc1.weight]["exp_avg"].abs().sum() > 0
    # Only the optimizer: parameters of the live model must not move.
    other, other_opt = build("plain", seed=4)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    bcp.load(tmp_path, {"optimizer": other_opt, "model": other}, strict=True)
    bcp.load(tmp_path, {"model": before}, strict=True)  # reload params from the ckpt: same values
    assert all(torch.equal(other.state_dict()[k], before[k]) for k in before)


def test_optimizer_init_step_leaves_parameters_bitwise(tmp_path):
    model, optimizer = trained()
    bcp.save(tmp_path, {"model": model, "optimizer": optimizer})
    fresh, fresh_opt = build("plain", seed=5)
    snapshot = {k: v.clone() for k, v in fresh.state_dict().items()}
    from bcp.adapters.optimizer import initialize_state

    initialize_state(fresh_opt)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in snapshot.items())
    assert all(p.grad is None for p in fresh.parameters())


def test_fqn_keyed_optimizer_dict_and_raw_dict(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model, optimizer = trained()
    bcp.save(tmp_path, {"model": model, "optimizer": get_optimizer_state_dict(model, optimizer)})
    fresh, fresh_opt = build("plain", seed=6)
    fresh(torch.randn(2, 12)).sum().backward()
    fresh_opt.step()
    osd = get_optimizer_state_dict(fresh, fresh_opt)
    bcp.load(tmp_path, {"model": fresh, "optimizer": osd})
    set_optimizer_state_dict(fresh, fresh_opt, osd)
    assert_bitwise(full_state(model, optimizer), full_state(fresh, fresh_opt))
    with pytest.raises(bcp.AdapterError, match="get_optimizer_state_dict"):
        bcp.save(tmp_path, {"model": model, "optimizer": optimizer.state_dict()})


def test_generations_replace_old_after_commit_and_roles_live_side_by_side(tmp_path):
    model, optimizer = trained()
    assert bcp.save(tmp_path, {"model": model}).generation == 1
    assert bcp.save(tmp_path, {"model": model}).generation == 2
    assert bcp.save(tmp_path, {"model": model}).generation == 3
    assert sorted(os.listdir(tmp_path)) == [METRICS_DIR, "gen-00000002", "gen-00000003"]  # the newest two are kept
    bcp.save(tmp_path, {"model": {"w": torch.ones(3)}}, role="critic")
    critic = {"w": torch.zeros(3)}
    bcp.load(tmp_path, {"model": critic}, role="critic")
    assert torch.equal(critic["w"], torch.ones(3))
    assert bcp.load(tmp_path, {"model": build("plain", 9)[0]}).generation == 3
    with pytest.raises(bcp.CheckpointError, match="invalid role"):
        bcp.save(tmp_path, {"model": critic}, role="../x")


def test_partial_save_keeps_the_previous_checkpoint_and_is_refused_alone(tmp_path):
    good = {"w": torch.arange(4.0)}
    bcp.save(tmp_path, {"model": good})
    # A save that died after writing data but before its commit marker:
    bcp.save(tmp_path / "scratch", {"model": {"w": torch.zeros(4)}})
    os.rename(tmp_path / "scratch" / "gen-00000001", tmp_path / "gen-00000002")
    os.remove(tmp_path / "gen-00000002" / "COMMITTED")
    out = {"w": torch.zeros(4)}
    assert bcp.load(tmp_path, {"model": out}).generation == 1
    assert torch.equal(out["w"], good["w"])
    only_partial = tmp_path / "only_partial"
    only_partial.mkdir()
    os.rename(tmp_path / "gen-00000002", only_partial / "gen-00000001")
    with pytest.raises(bcp.CheckpointNotCommittedError, match="never committed") as info:
        bcp.load(only_partial, {"model": out})
    assert str(only_partial) in str(info.value)


def test_failed_save_leaves_last_good_checkpoint(tmp_path):
    bcp.save(tmp_path, {"model": {"w": torch.arange(3.0)}})

    class Unstorable:
        pass

    with pytest.raises(bcp.UnsupportedValueError, match="Unstorable"):
        bcp.save(tmp_path, {"model": {"w": torch.ones(3)}, "extra_state": {"x": Unstorable()}})
    out = {"w": torch.zeros(3)}
    bcp.load(tmp_path, {"model": out})
    assert torch.equal(out["w"], torch.arange(3.0))


@pytest.mark.parametrize("make_path,error,match", [
    (lambda p: p / "missing", bcp.CheckpointNotFoundError, "no such checkpoint path"),
    (lambda p: p, bcp.CheckpointNotFoundError, "not a bcp checkpoint"),
])
def test_missing_and_foreign_paths(tmp_path, make_path, error, match):
    (tmp_path / "some_file.txt").write_text("hello")
    with pytest.raises(error, match=match):
        bcp.load(make_path(tmp_path), {"model": {"w": torch.zeros(1)}})


def test_shape_and_dtype_mismatch_name_the_tensor(tmp_path):
    bcp.save(tmp_path, {"model": {"w": torch.ones(2, 3)}})
    with pytest.raises(bcp.MismatchError, match=r"global shape mismatch.*'model/w'"):
        bcp.load(tmp_path, {"model": {"w": torch.zeros(3, 2)}})
    with pytest.raises(bcp.MismatchError, match=r"dtype mismatch.*float32.*float64.*'model/w'"):
        bcp.load(tmp_path, {"model": {"w": torch.zeros(2, 3, dtype=torch.float64)}})
    with pytest.raises(bcp.MismatchError, match=r"dtype mismatch.*cast_dtype=True"):
        bcp.load(tmp_path, {"model": {"w": torch.zeros(2, 3, dtype=torch.float64)}}, transactional=False)


@pytest.mark.parametrize("transactional", [True, False])
def test_cast_dtype_converts_on_request_only(tmp_path, transactional):
    saved = torch.arange(-3, 9, dtype=torch.int64).reshape(3, 4)
    bcp.save(tmp_path, {"model": {"w": saved, "same": saved.clone()}})
    # a live view into a bigger tensor: the conversion lands in the view, nothing beside it moves
    backing = torch.full((3, 6), 0.5, dtype=torch.float16)
    state = {"model": {"w": backing[:, 1:5], "same": torch.zeros(3, 4, dtype=torch.int64)}}
    bcp.load(tmp_path, state, cast_dtype=True, transactional=transactional)
    assert state["model"]["w"].dtype == torch.float16 and torch.equal(state["model"]["w"], saved.to(torch.float16))
    assert torch.equal(backing[:, 0], torch.full((3,), 0.5, dtype=torch.float16))
    assert torch.equal(backing[:, 5], torch.full((3,), 0.5, dtype=torch.float16))
    assert torch.equal(state["model"]["same"], saved)
    # a piece of the saved tensor, cast, through the reader door as integrations use it
    checkpoint = bcp.integration.open_checkpoint(tmp_path)
    piece = torch.zeros(2, 2, dtype=torch.float32)
    checkpoint.check_meta("model/w", piece.dtype, (3, 4), cast_dtype=True)
    box = bcp.integration.Box((1, 2), (2, 2))
    checkpoint.read_pieces([bcp.integration.Piece("model/w", piece.dtype, (3, 4), box, piece)])
    assert torch.equal(piece, saved[1:3, 2:4].float())


def test_strict_missing_and_unexpected_keys(tmp_path):
    bcp.save(tmp_path, {"model": {"a": torch.ones(2), "b": torch.ones(2)}, "extra_state": {"x": 1}})
    with pytest.raises(bcp.MismatchError, match=r"missing from the checkpoint: model/c.*not wanted on this rank: model/b"):
        bcp.load(tmp_path, {"model": {"a": torch.zeros(2), "c": torch.zeros(2)}})
    live = {"a": torch.zeros(2), "c": torch.zeros(2)}
    result = bcp.load(tmp_path, {"model": live}, strict=False)
    assert result.missing == ["model/c"] and result.unexpected == ["extra_state", "model/b"]  # not asked for
    assert torch.equal(live["a"], torch.ones(2)) and torch.equal(live["c"], torch.zeros(2))
    # Loading only the model from a full checkpoint is normal under strict.
    bcp.load(tmp_path, {"model": {"a": torch.zeros(2), "b": torch.zeros(2)}})


def test_flipped_byte_is_detected_naming_file_and_tensor(tmp_path):
    bcp.save(tmp_path, {"model": {"w": torch.arange(1000.0), "v": torch.ones(10)}})
    manifest = read_manifest(tmp_path)
    stored = manifest.tensors["model/w"].shards[0].bytes
    victim, offset = tmp_path / "gen-00000001" / manifest.files[stored.file], stored.offset
    raw = bytearray(victim.read_bytes())
    raw[offset + 17] ^= 0x01
    victim.write_bytes(bytes(raw))
    out = {"w": torch.zeros(1000), "v": torch.zeros(10)}
    with pytest.raises(bcp.CorruptCheckpointError, match=r"checksum mismatch in data/.*'model/w'"):
        bcp.load(tmp_path, {"model": out})
    bcp.load(tmp_path, {"model": out}, verify=False)  # switchable off: loads the damaged bytes
    assert not torch.equal(out["w"], torch.arange(1000.0))


def test_truncated_and_missing_data_files(tmp_path):
    bcp.save(tmp_path, {"model": {"w": torch.arange(1000.0)}})
    victim = data_files(tmp_path)[0]
    with open(victim, "r+b") as f:
        f.truncate(100)
    with pytest.raises(bcp.CorruptCheckpointError, match="truncated"):
        bcp.load(tmp_path, {"model": {"w": torch.zeros(1000)}})
    os.remove(victim)
    with pytest.raises(bcp.CorruptCheckpointError, match="missing"):
        bcp.load(tmp_path, {"model": {"w": torch.zeros(1000)}})


def test_unknown_format_version_and_tampered_manifest(tmp_path):
    bcp.save(tmp_path, {"model": {"w": torch.ones(2)}})
    manifest_path = tmp_path / "gen-00000001" / "manifest.json"
    doc = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps(doc | {"generation": 5}))
    with pytest.raises(bcp.CorruptCheckpointError, match="commit marker"):
        bcp.load(tmp_path, {"model": {"w": torch.zeros(2)}})
    # A checkpoint from a future bcp: valid marker, manifest of version 99.
    future = tmp_path / "v99"
    bcp.save(future, {"model": {"w": torch.ones(2)}})
    manifest_path = future / "gen-00000001" / "manifest.json"
    data = json.dumps(json.loads(manifest_path.read_text()) | {"version": 99}).encode()
    manifest_path.write_bytes(data)
    marker_path = future / "gen-00000001" / "COMMITTED"
    marker = json.loads(marker_path.read_text()) | {"manifest_bytes": len(data), "manifest_crc32c": crc32c(data)}
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(bcp.FormatVersionError, match="version 99"):
        bcp.load(future, {"model": {"w": torch.zeros(2)}})


def test_framework_forced_must_match_and_unknown_names_fail(tmp_path):
    model = MLP()
    with pytest.raises(bcp.AdapterError, match="framework='ddp' was requested.*'plain'"):
        bcp.save(tmp_path, {"model": model}, framework="ddp")
    with pytest.raises(bcp.AdapterError, match="unknown framework 'nope'"):
        bcp.save(tmp_path, {"model": model}, framework="nope")
    assert bcp.save(tmp_path, {"model": model}, framework="plain").generation == 1


def test_bad_state_arguments(tmp_path):
    with pytest.raises(bcp.CheckpointError, match="component names"):
        bcp.save(tmp_path, {"a/b": 1})
    with pytest.raises(bcp.CheckpointError, match="dict of components"):
        bcp.save(tmp_path, [nn.Linear(2, 2)])


def test_stateful_and_plain_components(tmp_path):
    model, optimizer = trained()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    optimizer.step()
    scheduler.step()
    bcp.save(tmp_path, {"model": model, "scheduler": scheduler, "epoch": 4})
    fresh, fresh_opt = build("plain", 2)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=99)
    state = {"model": fresh, "scheduler": fresh_sched, "epoch": 0}
    bcp.load(tmp_path, state)
    assert state["epoch"] == 4 and fresh_sched.state_dict() == scheduler.state_dict()


@pytest.mark.parametrize("version", sorted(int(p.name.removeprefix("format-v"))
                                           for p in (Path(__file__).parent.parent / "fixtures").glob("format-v*")
                                           if re.fullmatch(r"format-v\d+", p.name)))
def test_every_earlier_format_version_still_loads(version):
    from fixture_state import empty_like_fixture, fixture_state

    state = empty_like_fixture(version)
    held = {name: value for name, value in state.items() if name != "model"}
    bcp.load(Path(__file__).parent.parent / "fixtures" / f"format-v{version}", state,
             metrics_log=False)  # no log into the repo
    expected = fixture_state(version)
    for key, value in expected["model"].items():
        assert torch.equal(state["model"][key], value) and state["model"][key].dtype == value.dtype, key
    assert state["extra_state"] == expected["extra_state"]
    if version >= 2:
        assert state["ema"] is held["ema"] and state["rng"] is held["rng"]  # loaded in place
        assert torch.equal(state["ema"]["weight"], expected["ema"]["weight"]) and state["ema"]["decay"] == 0.99
        assert torch.equal(state["ema"]["history"][0], expected["ema"]["history"][0])
        assert torch.equal(state["rng"], expected["rng"])


def test_large_shard_is_read_in_parts_and_each_part_verified(tmp_path, monkeypatch):
    from bcp.engine import read_segments

    monkeypatch.setattr(read_segments, "READ_PART_BYTES", 1)  # parts of one checksum chunk
    big = torch.arange(3_000_000, dtype=torch.float32)  # 12 MB: several parts
    bcp.save(tmp_path, {"model": {"big": big}})
    out = {"big": torch.zeros(3_000_000)}
    assert bcp.load(tmp_path, {"model": out}).stats.bytes == 12_000_000
    assert torch.equal(out["big"], big)
    manifest = read_manifest(tmp_path)
    stored = manifest.tensors["model/big"].shards[0].bytes
    victim = tmp_path / "gen-00000001" / manifest.files[stored.file]
    raw = bytearray(victim.read_bytes())
    raw[stored.offset + 9_000_000] ^= 0xFF  # in a middle part
    victim.write_bytes(bytes(raw))
    chunk = manifest.checksum_chunk
    first = 9_000_000 // chunk * chunk
    with pytest.raises(bcp.CorruptCheckpointError, match=rf"at bytes \[{first}, {min(first + chunk, 12_000_000)}\)"):
        bcp.load(tmp_path, {"model": out})


def test_the_staging_pool_hands_out_a_free_buffer_that_is_not_the_first():
    """Guards a past defect: the pool removed the chosen buffer with ``list.remove``, which compares
    tensors with ``==``, so with buffers of different sizes free an async save failed ("The size of
    tensor a (3584) must match ...")."""
    from bcp.engine.staging import HostBufferPool

    pool = HostBufferPool(max_sets=2)
    large, small = pool.acquire(4096), pool.acquire(1024)
    pool.release(large)
    pool.release(small)
    assert pool.acquire(512) is small  # the smallest that fits, second in the free list
    assert pool.acquire(8192).numel() == 8192  # nothing fits: the other free buffer is dropped
    assert pool.allocated_bytes == 1024 + 8192
