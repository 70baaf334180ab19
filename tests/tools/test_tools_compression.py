"""The tools on compressed checkpoints: ``bcp inspect`` shows stored against raw bytes per tensor and
in total, ``bcp verify`` reports the stored bytes it checked, ``bcp edit --compress/--decompress``
rewrites a checkpoint's data (the raw bytes' checksums unchanged), ``bcp copy`` copies compressed
chunks as they are stored (no chunk compressed again), and ``export``, ``convert`` and ``read_tensor``
read compressed checkpoints bitwise."""

from __future__ import annotations

import json
import os

import pytest
import torch

import bcp
from bcp.cli import main
from bcp.tools import copy_checkpoint, edit_checkpoint, open_checkpoint, read_tensor
from bcp.tools.units import human_bytes
from chunk_counts import compressed_chunks
from tools_checkpoints import tree_digest

CODEC = "zstd"


def _trained_like(rows: int, columns: int, seed: int) -> torch.Tensor:
    """Weights whose exponent bytes repeat (as trained weights' do) and whose low mantissa bytes do not."""
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 0.02


def compressed_checkpoint(path: str, compression: str | None = CODEC) -> dict[str, torch.Tensor]:
    """bf16 and fp32 weights over several checksum chunks (saved whole and in two row shards), an
    incompressible uint8 tensor (its chunks stay raw), a tensor smaller than a chunk and a value."""
    tensors = {
        "model/embed.weight": _trained_like(8192, 768, 0).to(torch.bfloat16),   # 12 MiB: 12 chunks
        "model/fc.weight": _trained_like(640, 1024, 1),                         # 2.5 MiB: 3 chunks
        "model/noise": torch.randint(0, 256, (1 << 20,), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(2)),
        "model/bias": torch.zeros(16),
    }
    fc = tensors["model/fc.weight"]
    model = {"embed.weight": tensors["model/embed.weight"],
             "fc.weight": [bcp.TensorShard(fc[:320], tuple(fc.shape), (0, 0)),
                           bcp.TensorShard(fc[320:], tuple(fc.shape), (320, 0))],
             "noise": tensors["model/noise"], "bias": tensors["model/bias"]}
    bcp.save(path, {"model": model, "extra_state": {"step": 3}}, compression=compression)
    return tensors


@pytest.fixture
def ckpt(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    path = str(tmp_path / "ckpt")
    return path, compressed_checkpoint(path)


def _raw_crcs(path: str) -> dict[str, list]:
    """Each tensor's boxes with their raw bytes' chunk checksums."""
    checkpoint = open_checkpoint(path)
    return {name: sorted((s.box.offsets, s.box.lengths, s.bytes.crcs) for s in entry.shards)
            for name, entry in checkpoint.tensors.items()}


def _assert_reads_back(path: str, tensors: dict[str, torch.Tensor]) -> None:
    checkpoint = open_checkpoint(path)
    for name, tensor in tensors.items():
        assert torch.equal(checkpoint.read(name).view(torch.uint8), tensor.view(torch.uint8)), name


def test_inspect_shows_stored_and_raw_bytes_and_the_ratio_per_tensor_and_in_total(ckpt, capsys):
    path, tensors = ckpt
    assert main(["inspect", path, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = {t["name"]: t for t in summary["tensors"]}
    assert summary["format_version"] == 4 and summary["compression"]["codec"] == CODEC
    for name in ("model/embed.weight", "model/fc.weight"):
        row = rows[name]
        assert row["nbytes"] == tensors[name].nbytes and 0 < row["stored_nbytes"] < row["nbytes"], row
        assert row["ratio"] == pytest.approx(row["nbytes"] / row["stored_nbytes"], rel=1e-3)
    assert rows["model/noise"]["stored_nbytes"] == rows["model/noise"]["nbytes"]  # stored raw: it does not shrink
    assert rows["model/noise"]["ratio"] == 1.0
    assert summary["tensor_bytes"] == sum(t.nbytes for t in tensors.values())
    assert summary["stored_tensor_bytes"] == sum(t["stored_nbytes"] for t in summary["tensors"])
    assert summary["stored_tensor_bytes"] < summary["tensor_bytes"]
    assert summary["ratio"] == pytest.approx(summary["tensor_bytes"] / summary["stored_tensor_bytes"], rel=1e-3)

    assert main(["inspect", path, "--filter", "model/*.weight"]) == 0
    text = capsys.readouterr().out
    assert f"stored in {CODEC}" in text.splitlines()[4], text
    header = next(line for line in text.splitlines() if line.startswith("TENSOR"))
    assert header.split() == ["TENSOR", "DTYPE", "SHAPE", "SIZE", "STORED", "RATIO", "SHARDS", "LAYOUT"], header
    fc = next(line for line in text.splitlines() if line.startswith("model/fc.weight"))
    assert f" {rows['model/fc.weight']['ratio']:.2f}x " in fc, fc


def test_inspect_of_an_uncompressed_checkpoint_shows_no_compression(tmp_path, capsys):
    path = str(tmp_path / "raw")
    compressed_checkpoint(path, compression=None)
    assert main(["inspect", path, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format_version"] < 4 and summary["compression"] is None
    assert summary["stored_tensor_bytes"] == summary["tensor_bytes"] and summary["ratio"] == 1.0
    assert main(["inspect", path]) == 0
    assert "STORED" not in capsys.readouterr().out


def test_verify_checks_the_stored_bytes_and_says_so(ckpt, capsys):
    path, _ = ckpt
    summary = json.loads((main(["inspect", path, "--json"]), capsys.readouterr().out)[1])
    assert main(["verify", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stored = summary["stored_tensor_bytes"] + summary["value_bytes"]
    raw = summary["tensor_bytes"] + summary["value_bytes"]
    assert report["ok"] and (report["bytes_checked"], report["raw_bytes"]) == (stored, raw)
    assert main(["verify", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and out.rstrip().endswith(f"{human_bytes(stored)} stored ({human_bytes(raw)} raw) checked")


def test_edit_compress_and_decompress_keep_the_raw_checksums_and_every_byte(ckpt, tmp_path, capsys):
    path, tensors = ckpt
    before = tree_digest(path)
    plain, again = str(tmp_path / "plain"), str(tmp_path / "again")

    assert main(["edit", path, plain, "--decompress"]) == 0
    raw = open_checkpoint(plain).manifest
    assert raw.version < 4 and all(s.bytes.stored_nbytes == s.bytes.nbytes
                                   for e in raw.tensors.values() for s in e.shards)
    _assert_reads_back(plain, tensors)

    assert main(["edit", plain, again, f"--compress={CODEC}"]) == 0
    recompressed = open_checkpoint(again).manifest
    assert recompressed.version == 4
    assert _raw_crcs(again) == _raw_crcs(plain) == _raw_crcs(path)  # the raw bytes' checksums, unchanged
    _assert_reads_back(again, tensors)
    assert tree_digest(path) == before
    assert main(["verify", again]) == 0


def test_edit_keeps_the_source_compression_unless_told(ckpt, tmp_path):
    path, tensors = ckpt
    out = str(tmp_path / "renamed")
    edit_checkpoint(path, out, rules=bcp.tools.NameRules(rename=((r"^model/fc\.", "model/proj."),)))
    edited = open_checkpoint(out).manifest
    assert edited.version == 4 and edited.compression.codec == CODEC
    assert torch.equal(read_tensor(out, "model/proj.weight"), tensors["model/fc.weight"])


def test_removing_entries_in_place_keeps_the_rest_compressed(ckpt):
    path, tensors = ckpt
    bcp.remove_entries(path, ["model/noise"])
    edited = open_checkpoint(path)
    assert "model/noise" not in edited.tensors and edited.manifest.compression.codec == CODEC
    assert edited.tensors["model/fc.weight"].shards[0].bytes.stored is not None
    _assert_reads_back(path, {n: t for n, t in tensors.items() if n != "model/noise"})


def test_copy_keeps_compressed_chunks_as_stored_without_compressing_again(ckpt, tmp_path):
    path, tensors = ckpt
    out = str(tmp_path / "copy")
    with compressed_chunks() as copied:
        copy_checkpoint(path, out)
    with compressed_chunks() as recompressed:
        copy_checkpoint(path, str(tmp_path / "recompressed"), compression=CODEC)
    chunks = sum(len(s.bytes.crcs) for entry in open_checkpoint(path).tensors.values() for s in entry.shards)
    assert copied == [] and len(recompressed) == chunks  # the copy codes no chunk; one told to compress, each
    source, copy = open_checkpoint(path), open_checkpoint(out)
    for name, entry in source.tensors.items():
        assert [(s.box, s.bytes.stored_nbytes, s.bytes.stored) for s in entry.shards] == \
            [(s.box, s.bytes.stored_nbytes, s.bytes.stored) for s in copy.tensors[name].shards], name
    _assert_reads_back(out, tensors)
    assert main(["verify", out]) == 0


def test_copy_decompress_writes_a_checkpoint_older_bcp_reads(ckpt, tmp_path):
    path, tensors = ckpt
    out = str(tmp_path / "copy")
    assert main(["copy", path, out, "--decompress"]) == 0
    assert open_checkpoint(out).manifest.version < 4
    _assert_reads_back(out, tensors)


def test_export_and_convert_read_compressed_checkpoints_bitwise_and_convert_writes_them(ckpt, tmp_path):
    from safetensors.torch import load_file

    path, tensors = ckpt
    assert main(["export", path, "--to", "safetensors", str(tmp_path / "hf")]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name, tensor in tensors.items():
        assert torch.equal(exported[name.removeprefix("model/")].view(torch.uint8), tensor.view(torch.uint8)), name

    dcp_out = str(tmp_path / "dcp")
    assert main(["convert", "--to", "dcp", path, dcp_out]) == 0
    back = str(tmp_path / "back")
    assert main(["convert", "--from", "dcp", dcp_out, back, "--trust-pickle", f"--compress={CODEC}"]) == 0
    assert open_checkpoint(back).manifest.version == 4
    _assert_reads_back(back, tensors)

    from_hf = str(tmp_path / "from_hf")
    assert main(["convert", "--from", "hf", str(tmp_path / "hf"), from_hf, "--compress"]) == 0
    assert open_checkpoint(from_hf).manifest.compression.codec == CODEC
    _assert_reads_back(from_hf, tensors)


def test_a_slice_reads_only_the_chunks_that_cover_it(ckpt):
    path, tensors = ckpt
    checkpoint = open_checkpoint(path)
    rows = checkpoint.read("model/embed.weight", (slice(10, 20), ...))  # inside the first 1 MiB chunk
    assert torch.equal(rows.view(torch.uint8), tensors["model/embed.weight"][10:20].view(torch.uint8))
    first_chunk = open_checkpoint(path).tensors["model/embed.weight"].shards[0].bytes.stored.nbytes[0]
    assert checkpoint.bytes_read == first_chunk
