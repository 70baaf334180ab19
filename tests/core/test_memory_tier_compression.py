"""The memory tier with compression (2 ranks as 2 nodes, ``nodes=``): each rank's compressed data
files are copied to its peer node as they are (the copies equal the originals byte for byte), a
replaced node's rank loads bitwise from those copies, one rank of the surviving node alone loads
resharded, the persisted generation is a compressed checkpoint at the persistent path; and
incremental compressed saves refer to the unchanged chunks in the earlier generation without
compressing them again (the chunks compressed are counted). A save that names no compression
(``compression=False``) is uncompressed in a compressing tier, and loads back as saved."""

from __future__ import annotations

import filecmp
import os
import shutil

import pytest
import torch

import bcp
from bcp.tools import open_checkpoint
from chunk_counts import compressed_chunks
from lora_models import SAVES, build_lora, load_generation
from models import assert_bitwise, full_state, rank, train

CODEC = "zstd"


def _tier(root: str, nodes: list[str]) -> bcp.MemoryTier:
    return bcp.MemoryTier(os.path.join(root, "persistent"), local_dir=os.path.join(root, "tier"), nodes=nodes,
                          persist_every=SAVES, compression=CODEC)


def save_compressed_fine_tuning(root: str) -> list[dict]:
    """Three incremental saves to the compressing tier, training the adapters in between; each save's
    count of chunks compressed on this rank."""
    model, optimizer = build_lora("fsdp2", seed=1)
    out = []
    for save in range(SAVES):
        train(model, optimizer, range(2 * save, 2 * save + 2))
        with compressed_chunks() as compressed:
            handle = bcp.save(_tier(root, ["a", "b"]), {"model": model, "optimizer": optimizer,
                                                        "extra_state": {"save": save}}, incremental=True)
        state = full_state(model, optimizer)
        out.append({"chunks": len(compressed), "reused": handle.stats.reused_bytes,
                    "state": state if rank() == 0 else None})
    return out


def _chunks(manifest, own: bool) -> int:
    """The chunks of the shards the generation's own files hold (``own``), or of those it refers to."""
    return sum(len(s.bytes.crcs) for entry in manifest.tensors.values() for s in entry.shards
               if manifest.files[s.bytes.file].startswith("gen-") != own)


def _stored(manifest) -> dict[str, list]:
    return {name: [(s.box, s.bytes.stored_nbytes, s.bytes.stored) for s in entry.shards]
            for name, entry in manifest.tensors.items()}


def test_compressed_tier_saves_replicate_as_stored_reuse_unchanged_chunks_and_load_bitwise(ranks, tmp_path):
    root = str(tmp_path)
    saves = ranks(2).run(save_compressed_fine_tuning, root)
    tier = tmp_path / "tier"
    manifest = open_checkpoint(tier / "node-a").manifest
    assert manifest.version == 4 and manifest.earlier_generations() == {1}
    base = manifest.tensors["model/base2.weight"].shards[0].bytes
    assert manifest.files[base.file].startswith("gen-00000001/") and base.stored_nbytes < base.nbytes
    # The third save compressed exactly the chunks it wrote, none of those it refers to in generation 1.
    written, referred = _chunks(manifest, own=True), _chunks(manifest, own=False)
    assert referred > 0 and sum(r["reused"] for r in saves[1]) > 0
    assert sum(r[-1]["chunks"] for r in saves) == written
    assert sum(r[0]["chunks"] for r in saves) == written + referred  # the first save compressed them all

    copies = sorted((tier / "node-a").glob("gen-*/data/00001-*.bin"))  # rank 1's files, copied from node b
    assert len(copies) == 2, copies  # generation 1's and generation 3's
    for copy in copies:
        assert filecmp.cmp(copy, tier / "node-b" / copy.relative_to(tier / "node-a"), shallow=False), copy

    persisted = open_checkpoint(tmp_path / "persistent").manifest  # the third save, a checkpoint of its own
    assert persisted.version == 4 and not persisted.earlier_generations()
    assert _stored(persisted) == _stored(manifest)  # the compressed chunks copied as they are

    shutil.rmtree(tier / "node-b")  # node b replaced: its rank loads from node a's copies
    loaded = ranks(2).run(load_generation, "fsdp2", _tier(root, ["a", "b"]), None)
    assert_bitwise(saves[0][-1]["state"], loaded[0]["state"])
    survivor = load_generation("plain", _tier(root, ["a"]), None)  # node b lost: node a alone, on one rank
    assert_bitwise(saves[0][-1]["state"], survivor["state"])
    alone = load_generation("plain", str(tmp_path / "persistent"), None)
    assert_bitwise(saves[0][-1]["state"], alone["state"])


def test_an_unknown_codec_is_refused_when_the_tier_is_made(tmp_path):
    with pytest.raises(bcp.CheckpointError, match=r"MemoryTier\(compression=\.\.\.\): unknown compression codec 'lz9'"):
        bcp.MemoryTier(local_dir=str(tmp_path), compression="lz9")
    assert bcp.MemoryTier(local_dir=str(tmp_path), compression=True).compression is True


def test_a_save_that_names_no_compression_is_uncompressed_in_a_compressing_tier(tmp_path):
    tier = bcp.MemoryTier(local_dir=str(tmp_path), nodes=["a"], compression=CODEC)
    weights = torch.zeros(1 << 18)  # 1 MiB that zstd shrinks to almost nothing
    saves = {"keyword": {"compression": False}, "options": {"options": bcp.SaveOptions(compression=False)},
             "asynchronous": {"compression": False, "async_save": True}, "tier's own": {}}
    for how, keywords in saves.items():
        bcp.save(tier, {"model": {"weights": weights}}, **keywords).wait()
        manifest = open_checkpoint(tmp_path / "node-a").manifest
        compressed = manifest.tensors["model/weights"].shards[0].bytes.stored_nbytes < weights.nbytes
        assert compressed == (how == "tier's own") and (manifest.version == 4) == compressed, how
        loaded = {"model": {"weights": torch.ones_like(weights)}}
        bcp.load(tier, loaded)
        assert torch.equal(loaded["model"]["weights"], weights), how
