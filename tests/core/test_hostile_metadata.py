"""Forged metadata: every field of the manifest, the shard table, the commit
marker and value records is checked for type and range when it is parsed, and claimed sizes are
compared with what exists before anything is allocated. Each forgery is signed (the marker matches
the forged manifest), so it reaches the parser; each must fail with a ``CheckpointError`` naming
the checkpoint (or, in ``verify``, be reported as a problem), never another exception.

Guards past defects: shapes beyond int64 raised ``OverflowError``, deep JSON ``RecursionError``,
fields of the wrong type ``ValueError``/``TypeError``, and claimed sizes (a 4 TiB value, a table of
``2**20`` dimensions, a 1 GiB value record) were allocated before anything noticed they were false."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import bcp
from bcp.cli import main
from bcp.tools.verify import verify_checkpoint
from hostile_forge import (GEN, CappedChild, empty_state, files, forge, forge_value, make_checkpoint, outcome,
                           sign_table, write_signed)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return make_checkpoint(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def child():
    with CappedChild(headroom=512 << 20) as worker:
        yield worker


@pytest.mark.parametrize("shape", [[2**63], [2**64], [2**32, 2**32], [2**62, 3]])
def test_shapes_beyond_int64_are_refused(ckpt, shape):
    def change(doc):
        doc["tensors"]["model/huge"] = {"dtype": "float32", "shape": shape,
                                        "shards": [doc["shard_table"]["count"], 0]}
    forge(ckpt, change)
    with pytest.raises(bcp.CorruptCheckpointError, match="model/huge"):
        bcp.load(ckpt, empty_state())
    with pytest.raises(bcp.CorruptCheckpointError, match="int64"):
        verify_checkpoint(ckpt)
    assert main(["inspect", str(ckpt)]) == 1


@pytest.mark.parametrize("value", ["yesterday", [], {"a": 1}, True, float("nan")])
@pytest.mark.parametrize("field", ["created_unix", "writer", "unsafe_pickle", "generation", "world_size"])
def test_fields_of_the_wrong_type_are_refused(ckpt, field, value):
    if (field, type(value)) in (("writer", str), ("unsafe_pickle", bool)):
        return  # the right type for this field
    forge(ckpt, lambda doc: doc.__setitem__(field, value))
    with pytest.raises(bcp.CorruptCheckpointError, match=field):
        bcp.load(ckpt, empty_state())
    with pytest.raises(bcp.CorruptCheckpointError, match=field):
        verify_checkpoint(ckpt)


@pytest.mark.parametrize("value", [10**400, -10**400, 10**12])
def test_a_creation_time_beyond_any_date_is_refused(ckpt, value):
    """A huge integer ``created_unix`` made load and ``bcp verify`` crash with ``OverflowError``."""
    forge(ckpt, lambda doc: doc.__setitem__("created_unix", value))
    with pytest.raises(bcp.CorruptCheckpointError, match="'created_unix' is .* not a time in seconds"):
        bcp.load(ckpt, empty_state())
    with pytest.raises(bcp.CorruptCheckpointError, match="created_unix"):
        verify_checkpoint(ckpt)
    assert main(["verify", str(ckpt)]) == 1


def test_deeply_nested_json_is_refused(ckpt):
    manifest, _, _ = files(ckpt)
    deep = manifest.replace(b'"writer":"', b'"deep":' + b"[" * 5000 + b"]" * 5000 + b',"writer":"', 1)
    write_signed(ckpt, deep)
    with pytest.raises(bcp.CorruptCheckpointError, match="nested too deeply"):
        bcp.load(ckpt, empty_state())


def test_a_box_whose_end_wraps_int64_is_refused(ckpt):
    manifest, table, _ = files(ckpt)
    doc = json.loads(manifest)
    raw = bytearray(table)
    raw[0:8] = (2**63 - 1).to_bytes(8, "little", signed=True)  # row 0's offset in dim 0: + length wraps
    sign_table(doc, bytes(raw))
    write_signed(ckpt, json.dumps(doc).encode(), bytes(raw))
    with pytest.raises(bcp.CorruptCheckpointError, match="outside its tensor's global shape"):
        bcp.load(ckpt, empty_state())


def test_file_names_with_control_characters_are_refused(ckpt):
    forge(ckpt, lambda doc: doc["files"].__setitem__(0, "data/\u0000.bin"))
    with pytest.raises(bcp.CorruptCheckpointError, match="relative paths"):
        bcp.load(ckpt, empty_state())


def test_a_table_claiming_a_million_dimensions_costs_no_memory(ckpt, child):
    def change(doc):
        doc["shard_table"]["ndim"] = 2**20
        doc["shard_table"]["count"] = 0
        for entry in doc["tensors"].values():
            entry["shards"] = [0, 0]
        doc["tensors"].update({f"model/t{i}": {"dtype": "float32", "shape": [1], "shards": [0, 0]} for i in range(300)})
    forge(ckpt, change)
    loaded = child.call(_load_outcome, str(ckpt))
    assert loaded.startswith("CorruptCheckpointError") and "ndim" in loaded, loaded


@pytest.mark.parametrize("tree", [
    {"$tensor": {"dtype": "float32", "shape": [2**40], "at": [0, 0]}},     # 4 TiB claimed, 0 bytes stored
    {"$tensor": {"dtype": "float32", "shape": [2**64], "at": [0, 0]}},
    {"$ndarray": {"dtype": "<f8", "shape": [2**40, 2**40], "at": [0, 0]}},
])
def test_a_value_claiming_a_huge_tensor_is_refused_before_allocating(ckpt, child, tree):
    forge_value(ckpt, "extra_state", json.dumps(tree).encode())
    loaded, problems = child.call(_load_and_verify, str(ckpt))
    assert loaded.startswith("CorruptCheckpointError") and "extra_state" in loaded, loaded
    assert len(problems) == 1 and "malformed value record" in problems[0], problems


@pytest.mark.parametrize("tree", [
    {"$device": "nonsense"}, {"$complex": [1, 2, 3]}, {"$dict": [[{"$dict": []}, 1]]},
    {"$set": [{"$dict": []}]}, {"$tuple": 5}, {"$size": [[1]]}, {"$frozenset": [[{"$set": []}]]},
    {"$dict": [[1]]}, {"$path": {"$bytes": [0, 99]}}, ["[" * 3000],
])
def test_malformed_value_tags_are_reported_and_bcp_verify_exits_1(ckpt, capsys, tree):
    text = json.dumps(tree).encode() if tree != ["[" * 3000] else b"[" * 3000 + b"]" * 3000
    forge_value(ckpt, "extra_state", text)
    with pytest.raises(bcp.CorruptCheckpointError, match="extra_state"):
        bcp.load(ckpt, empty_state())
    report = verify_checkpoint(ckpt)
    assert [p.entry for p in report.problems] == ["extra_state"]
    assert main(["verify", str(ckpt)]) == 1
    out = capsys.readouterr()
    assert "PROBLEM extra_state: " in out.out and "Traceback" not in out.err


def test_a_value_record_claiming_a_gibibyte_is_reported_truncated_by_verify_without_reading(ckpt, child):
    def change(doc):
        record = doc["objects"]["extra_state"]["records"][0]
        record[2] = 1 << 30
        record[4] = [0] * 1024  # one checksum per MiB chunk, as a 1 GiB record has
    forge(ckpt, change)
    _, problems = child.call(_load_and_verify, str(ckpt))
    assert len(problems) == 1 and "is truncated" in problems[0], problems


@pytest.mark.parametrize("field, value, error, match", [
    ("version", 2, bcp.FormatVersionError, "version 2"),
    ("version", "1", bcp.FormatVersionError, "version '1'"),
    ("version", True, bcp.FormatVersionError, "version True"),
    ("generation", 7, bcp.CorruptCheckpointError, "generation 7"),
    ("generation", "1", bcp.CorruptCheckpointError, "generation '1'"),
    ("manifest_bytes", 2**70, bcp.CorruptCheckpointError, "out of range"),
    ("manifest_crc32c", -1, bcp.CorruptCheckpointError, "out of range"),
])
def test_commit_marker_fields_are_checked(ckpt, field, value, error, match):
    marker_path = ckpt / GEN / "COMMITTED"
    marker = json.loads(marker_path.read_bytes())
    marker[field] = value
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(error, match=match):
        bcp.load(ckpt, empty_state())
    with pytest.raises(error, match=match):
        verify_checkpoint(ckpt)


def test_garbage_appended_to_a_data_file_is_reported_by_verify(ckpt):
    with open(ckpt / GEN / "data" / "00000-00.bin", "ab") as f:
        f.write(b"appended")
    report = verify_checkpoint(ckpt)
    assert [p.message.split(" (")[0] for p in report.problems] == [
        "data file data/00000-00.bin has 8 bytes after its last stored range"]
    assert main(["verify", str(ckpt)]) == 1


@pytest.mark.parametrize("role", ["x\n", "a/b", "", "gen-00000001", "..", "-x"])
def test_roles_must_be_whole_names(tmp_path, role):
    with pytest.raises(bcp.CheckpointError, match="invalid role"):
        bcp.save(tmp_path, {"model": {"w": torch.ones(2)}}, role=role)
    assert not list(tmp_path.iterdir())


def _load_outcome(path: str) -> str:
    return outcome(lambda: bcp.load(path, empty_state()))


def _load_and_verify(path: str) -> tuple[str, list[str]]:
    """In the child: the outcome of ``bcp.load`` and the problems ``verify`` reports."""
    return _load_outcome(path), [p.message for p in verify_checkpoint(path).problems]
