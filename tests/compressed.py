"""What the integrations' compression tests check of a checkpoint they wrote: format version 4,
the save's compression recorded, and fewer bytes stored than the tensors hold."""

from __future__ import annotations

from typing import Any

from bcp.integration import open_checkpoint


def stored_and_raw(path: Any, generation: int | None = None) -> tuple[int, int]:
    """The bytes the checkpoint's tensors take in its files, and the bytes they hold."""
    manifest = open_checkpoint(path, generation=generation).manifest
    ranges = [shard.bytes for entry in manifest.tensors.values() for shard in entry.shards]
    return sum(r.stored_nbytes for r in ranges), sum(r.nbytes for r in ranges)


def assert_compressed(path: Any, generation: int | None = None) -> None:
    manifest = open_checkpoint(path, generation=generation).manifest
    assert manifest.version == 4 and manifest.compression is not None, (manifest.version, manifest.compression)
    stored, raw = stored_and_raw(path, generation)
    assert stored < raw, (stored, raw)
