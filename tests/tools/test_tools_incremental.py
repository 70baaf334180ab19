"""The tools on checkpoints written by incremental saves: they follow the shard rows into the
earlier generation that stores the bytes (verify, read_tensor, edit, export, convert), ``bcp copy``
makes a generation a checkpoint of its own, and a damaged or missing earlier generation is named."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import bcp
from bcp.cli import main
from bcp.tools import open_checkpoint, read_tensor
from lora_models import build_lora
from models import assert_bitwise, full_state, train

BASE = "model/base2.weight"


@pytest.fixture()
def incremental(tmp_path) -> tuple[str, dict]:
    """Three incremental saves keeping one generation: generation 3 (its base in generation 1's file)."""
    path = str(tmp_path / "ckpt")
    model, optimizer = build_lora("plain", seed=1)
    for save in range(3):
        train(model, optimizer, range(save, save + 1))
        bcp.save(path, {"model": model, "optimizer": optimizer, "extra_state": {"save": save}}, incremental=True,
                 keep_generations=1)
    assert sorted(os.listdir(path))[:3] == ["bcp-metrics", "gen-00000001", "gen-00000003"]
    return path, full_state(model, optimizer)


def _flip_in_earlier_file(path: str, name: str, at: int) -> str:
    checkpoint = open_checkpoint(path)
    where = checkpoint.tensors[name].shards[0].bytes
    file = checkpoint.manifest.files[where.file]
    assert file.startswith("gen-00000001/")
    with open(os.path.join(path, file), "r+b") as f:
        f.seek(where.offset + at)
        byte = f.read(1)
        f.seek(where.offset + at)
        f.write(bytes([byte[0] ^ 0x40]))
    return file


def test_verify_checks_the_bytes_in_the_earlier_generation_and_names_a_flipped_one(incremental, capsys):
    path, _ = incremental
    assert main(["verify", path]) == 0
    assert "OK" in capsys.readouterr().out
    file = _flip_in_earlier_file(path, BASE, at=1_200_000)  # in the second checksum chunk
    assert main(["verify", path, "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert [p["entry"] for p in problems] == [BASE]
    assert "checksum mismatch" in problems[0]["message"] and file in problems[0]["message"]
    with pytest.raises(bcp.CorruptCheckpointError, match="checksum mismatch"):
        read_tensor(path, BASE)


def test_read_edit_export_and_convert_follow_the_rows_into_the_earlier_generation(incremental, tmp_path):
    path, expected = incremental
    assert torch.equal(read_tensor(path, BASE), expected[BASE])
    assert torch.equal(read_tensor(path, BASE, (slice(600, 640), 3)), expected[BASE][600:640, 3])

    assert main(["edit", path, str(tmp_path / "edited"), "--drop", "optimizer/*"]) == 0
    assert torch.equal(read_tensor(tmp_path / "edited", BASE), expected[BASE])

    from safetensors.torch import load_file

    assert main(["export", path, "--to", "safetensors", str(tmp_path / "hf")]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(exported["base2.weight"], expected[BASE])

    import torch.distributed.checkpoint as dcp

    assert main(["convert", path, str(tmp_path / "dcp")]) == 0
    model = {"base2.weight": torch.zeros(640, 640)}
    dcp.load({"model": model}, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(model["base2.weight"], expected[BASE])


def test_bcp_copy_makes_a_generation_a_checkpoint_of_its_own(incremental, tmp_path, capsys):
    path, expected = incremental
    out = str(tmp_path / "copy")
    assert main(["copy", path, out]) == 0
    assert "refers to nothing outside it" in capsys.readouterr().out
    manifest = open_checkpoint(out).manifest
    assert manifest.version < 3 and manifest.earlier_generations() == set()
    assert all(not name.startswith("gen-") for name in manifest.files)
    shutil.rmtree(path)  # the source is gone: the copy holds every byte
    model, optimizer = build_lora("plain", seed=2)
    train(model, optimizer, range(1))
    state = {"model": model, "optimizer": optimizer, "extra_state": None}
    bcp.load(out, state)
    assert_bitwise(expected, full_state(model, optimizer))
    assert state["extra_state"] == {"save": 2} and main(["verify", out]) == 0


def test_an_older_generation_copies_too(incremental, tmp_path):
    path, _ = incremental
    assert main(["copy", path, str(tmp_path / "first"), "--generation", "1"]) == 0
    assert open_checkpoint(tmp_path / "first").read_object("extra_state") == {"save": 0}


def test_a_missing_earlier_generation_is_named_by_load_and_verify(incremental, capsys):
    path, _ = incremental
    shutil.rmtree(os.path.join(path, "gen-00000001"))  # removed by hand, not by retention
    model, optimizer = build_lora("plain", seed=2)
    with pytest.raises(bcp.CorruptCheckpointError, match="gen-00000001.*gone"):
        bcp.load(path, {"model": model, "optimizer": optimizer}, strict=False)
    assert main(["verify", path]) == 1
    assert "lies in gen-00000001, which is not committed" in capsys.readouterr().out
