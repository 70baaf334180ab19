"""Safetensors input: ``bcp convert --from hf`` on folders written by the safetensors library, and
the checked header reader refusing hostile or damaged files."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

import bcp
from bcp.cli import main
from bcp.tools import CastRules, NameRules, convert_hf_to_bcp, open_checkpoint
from bcp.tools.safetensors_format import SafetensorsFile, encode_header

safetensors_torch = pytest.importorskip("safetensors.torch")


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(16, 4, generator=g), "layers.0.w": torch.randn(4, 4, generator=g),
            "layers.1.w": torch.randn(4, 4, generator=g).to(torch.bfloat16), "steps": torch.arange(3),
            "flag": torch.tensor([True, False])}


def sharded_folder(path, tensors: dict[str, torch.Tensor]) -> None:
    os.makedirs(path)
    names = list(tensors)
    files = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for file, keys in files.items():
        safetensors_torch.save_file({k: tensors[k] for k in keys}, os.path.join(path, file), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: file for file, keys in files.items() for k in keys}}, f)


def test_a_sharded_folder_converts_bitwise(tmp_path):
    tensors = weights()
    sharded_folder(tmp_path / "hf", tensors)

    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0  # format detected

    checkpoint = open_checkpoint(tmp_path / "ckpt")
    assert sorted(checkpoint.tensors) == sorted(f"model/{k}" for k in tensors)
    for key, tensor in tensors.items():
        assert torch.equal(checkpoint.read(f"model/{key}"), tensor)
    live = {key: torch.zeros_like(t) for key, t in tensors.items()}
    bcp.load(str(tmp_path / "ckpt"), {"model": live})
    assert all(torch.equal(live[k], tensors[k]) for k in tensors)


def test_convert_renames_casts_and_ties(tmp_path):
    tensors = weights()
    safetensors_torch.save_file(tensors, str(tmp_path / "weights.safetensors"))

    rules = NameRules(drop=("student/steps",), rename=((r"^student/layers\.", "student/blocks."),))
    result = convert_hf_to_bcp(tmp_path / "weights.safetensors", tmp_path / "ckpt", component="student",
                               rules=rules, casts=CastRules.parse(["float16"]), ties={"head.weight": "embed.weight"})

    checkpoint = open_checkpoint(tmp_path / "ckpt")
    assert sorted(checkpoint.tensors) == ["student/blocks.0.w", "student/blocks.1.w", "student/embed.weight",
                                          "student/flag", "student/head.weight"]
    assert result.tied == {"student/head.weight": "student/embed.weight"}
    head, embed = checkpoint.tensors["student/head.weight"], checkpoint.tensors["student/embed.weight"]
    assert head.shards == embed.shards  # one copy of the bytes, two names
    assert torch.equal(checkpoint.read("student/head.weight"), tensors["embed.weight"].half())
    assert checkpoint.read("student/flag").dtype == torch.bool  # only floating tensors are cast
    assert main(["verify", str(tmp_path / "ckpt")]) == 0


def test_folders_without_safetensors_are_refused_with_a_reason(tmp_path, capsys):
    os.makedirs(tmp_path / "pickled")
    torch.save({"w": torch.ones(1)}, tmp_path / "pickled" / "pytorch_model.bin")
    assert main(["convert", "--from", "hf", str(tmp_path / "pickled"), str(tmp_path / "out")]) == 1
    assert "pytorch_model.bin are pickles, which bcp does not read" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "pickled"), str(tmp_path / "out")]) == 1
    assert "cannot tell the format" in capsys.readouterr().err
    with pytest.raises(bcp.CheckpointError, match="cannot tie 'a' to 'nope'"):
        safetensors_torch.save_file(weights(), str(tmp_path / "w.safetensors"))
        convert_hf_to_bcp(tmp_path / "w.safetensors", tmp_path / "out2", ties={"a": "nope"})


def hostile(header: object, data: bytes = b"\0" * 16, length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


@pytest.mark.parametrize("content,reason", [
    (b"\x01\x02", "shorter than the 8-byte header length"),
    (hostile({}, length=1 << 40), "exceeds the file"),
    (struct.pack("<Q", 3) + b"{x}", "header is not JSON"),
    (hostile([1, 2]), "header is not a JSON object"),
    (hostile({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}), "unknown dtype 'F99'"),
    (hostile({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}), "shape must be a list"),
    (hostile({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 64]}}), "not a range inside the file"),
    (hostile({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}), "do not span shape x dtype size"),
    (hostile({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}), "overlap"),
    (hostile({"__metadata__": {"format": 1}}), "__metadata__ must map strings to strings"),
])
def test_hostile_headers_are_refused(tmp_path, content, reason, capsys):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(bcp.CorruptCheckpointError, match=reason):
        SafetensorsFile(str(path))
    assert main(["convert", str(path), str(tmp_path / "out")]) == 1
    assert "invalid safetensors file" in capsys.readouterr().err


def test_written_headers_keep_tensors_aligned_and_the_library_agrees(tmp_path):
    tensors = {"byte": torch.ones(3, dtype=torch.uint8), "double": torch.arange(2, dtype=torch.float64)}
    prefix, entries = encode_header([("double", torch.float64, (2,)), ("byte", torch.uint8, (3,))], {"format": "pt"})
    assert (len(prefix) - 8) % 8 == 0 and [(e.begin, e.end) for e in entries] == [(0, 16), (16, 19)]
    path = tmp_path / "mine.safetensors"
    path.write_bytes(prefix + tensors["double"].numpy().tobytes() + tensors["byte"].numpy().tobytes())
    loaded = safetensors_torch.load_file(str(path))
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    truncated = tmp_path / "short.safetensors"
    truncated.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(bcp.CorruptCheckpointError, match="not a range inside the file"):
        SafetensorsFile(str(truncated))
