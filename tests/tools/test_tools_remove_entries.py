"""``bcp.remove_entries``: entries dropped from a checkpoint in place, their stored bytes with them;
everything else is read back as saved, shards and values included, and older generations are gone."""

from __future__ import annotations

import os

import pytest
import torch

import bcp
from bcp.cli import main
from bcp.tools import open_checkpoint
from tools_checkpoints import sharded_checkpoint


def _stored(path: str) -> bytes:
    return b"".join(open(os.path.join(folder, name), "rb").read()
                    for folder, _, files in sorted(os.walk(path)) for name in sorted(files))


def _generations(path: str) -> list[str]:
    return sorted(name for name in os.listdir(path) if name.startswith("gen-"))


def test_removed_entries_and_their_bytes_are_gone_the_rest_is_as_saved(tmp_path):
    path = str(tmp_path / "ckpt")
    sharded_checkpoint(path)
    tensors = sharded_checkpoint(path)  # a second generation, which also holds the removed bytes
    before = open_checkpoint(path)
    shard = tensors["model/grid.weight"][:3, :4].contiguous().numpy().tobytes()  # as stored: one shard's box
    assert shard in _stored(path)

    result = bcp.remove_entries(path, ["model/grid.weight", "model/note"])

    after = open_checkpoint(path)
    assert (result.generation, result.dropped) == (3, 2) and _generations(path) == ["gen-00000003"]
    assert shard not in _stored(path)
    assert sorted(after.tensors) == sorted(set(tensors) - {"model/grid.weight"})
    assert sorted(after.objects) == sorted(set(before.objects) - {"model/note"})
    for name in after.tensors:
        assert torch.equal(after.read(name), tensors[name])
        assert [s.box for s in after.tensors[name].shards] == [s.box for s in before.tensors[name].shards]
    assert after.read_object("extra_state")["step"] == 7
    assert main(["verify", path]) == 0


def test_an_unknown_name_is_refused_naming_the_checkpoint_and_changes_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    sharded_checkpoint(path)

    with pytest.raises(bcp.MismatchError, match=r"'model/absent'.*no such entry") as raised:
        bcp.remove_entries(path, ["model/embed.weight", "model/absent"])

    assert path in str(raised.value) and _generations(path) == ["gen-00000001"]
