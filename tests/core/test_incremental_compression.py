"""Incremental saves with compression: the boxes an earlier generation stores are referred to with
their compressed chunks as stored (no chunk of them compressed again: the codec's calls are
counted), the later generation verifies and loads bitwise, and a flipped byte in a referred
compressed chunk is named by ``bcp verify`` and refused by a load."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import bcp
from bcp.tools import open_checkpoint, verify_checkpoint
from chunk_counts import compressed_chunks
from lora_models import build_lora, frozen_nbytes
from models import assert_bitwise, full_state, train

CODEC = "zstd"
BASE = "model/base2.weight"


@pytest.fixture
def compressed_calls() -> Iterator[list[int]]:
    with compressed_chunks() as calls:
        yield calls


def _save_three_times(path: str, calls: list[int]) -> list[dict]:
    model, optimizer = build_lora("plain", seed=1)
    saves = []
    for save in range(3):
        train(model, optimizer, range(save, save + 1))
        calls.clear()
        handle = bcp.save(path, {"model": model, "optimizer": optimizer}, incremental=True, compression=CODEC,
                          keep_generations=3)
        saves.append({"chunks": len(calls), "reused": handle.stats.reused_bytes, "frozen": frozen_nbytes(model),
                      "state": full_state(model, optimizer), "generation": handle.generation})
    return saves


def test_unchanged_compressed_chunks_are_referred_to_not_compressed_again(tmp_path, compressed_calls):
    path = str(tmp_path / "ckpt")
    saves = _save_three_times(path, compressed_calls)
    first, later = saves[0], saves[1:]
    base_chunks = len(open_checkpoint(path, generation=1).tensors[BASE].shards[0].bytes.stored.nbytes)
    assert first["chunks"] >= base_chunks and all(s["reused"] >= s["frozen"] for s in later)
    # Only the adapters and AdamW's state are compressed again: not one chunk of the frozen base.
    assert all(s["chunks"] <= first["chunks"] - base_chunks for s in later), saves

    newest, base = open_checkpoint(path), open_checkpoint(path, generation=1)
    referred, stored = newest.tensors[BASE].shards[0].bytes, base.tensors[BASE].shards[0].bytes
    assert newest.manifest.version == 4 and newest.manifest.files[referred.file] == "gen-00000001/data/00000-00.bin"
    assert (referred.offset, referred.nbytes, referred.crcs, referred.stored) == \
        (stored.offset, stored.nbytes, stored.crcs, stored.stored)  # the chunks as the base stores them
    assert referred.stored_nbytes < referred.nbytes  # the frozen base is stored compressed
    assert verify_checkpoint(path).ok
    for save in saves:
        model, optimizer = build_lora("plain", seed=2)
        bcp.load(path, {"model": model, "optimizer": optimizer}, generation=save["generation"])
        assert_bitwise(save["state"], full_state(model, optimizer))


def test_a_flipped_byte_in_a_referred_compressed_chunk_is_named_and_refused(tmp_path, compressed_calls):
    path = str(tmp_path / "ckpt")
    _save_three_times(path, compressed_calls)
    where = open_checkpoint(path).tensors[BASE].shards[0].bytes
    with open(os.path.join(path, "gen-00000001", "data", "00000-00.bin"), "r+b") as f:
        at = where.offset + where.stored.nbytes[0] + 7  # inside the second stored chunk
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x20]))
    report = verify_checkpoint(path)
    assert [p.entry for p in report.problems] == [BASE], report.problems
    assert "gen-00000001/data/00000-00.bin" in report.problems[0].message
    model, optimizer = build_lora("plain", seed=2)
    with pytest.raises(bcp.CorruptCheckpointError, match=r"compressed chunk 1 in gen-00000001/data/00000-00\.bin at "
                                                         r"bytes \[\d+, \d+\) does not match the checksum of its stored"):
        bcp.load(path, {"model": model, "optimizer": optimizer})
