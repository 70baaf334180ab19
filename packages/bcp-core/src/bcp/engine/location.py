"""Where a checkpoint lives on storage: generations, the manifest, data files and the commit marker.

A checkpoint path holds generations ``gen-00000001/``, ``gen-00000002/``, ...; saving again writes a
new generation and the newest committed one is the checkpoint. A generation is committed once its
``COMMITTED`` marker exists (created last, create-if-absent, no rename needed).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from bcp.engine.checksum import crc_of
from bcp.errors import CheckpointNotCommittedError, CheckpointNotFoundError, CorruptCheckpointError
from bcp.layout.manifest import FORMAT_NAME, FORMAT_VERSION, SHARD_TABLE, Manifest
from bcp.storage.base import Storage

MANIFEST = "manifest.json"
COMMIT_MARKER = "COMMITTED"
DATA_DIR = "data"
_GENERATION = re.compile(r"^gen-(\d{8})$")


def generation_dir(generation: int) -> str:
    return f"gen-{generation:08d}"


def data_file_name(rank: int, index: int) -> str:
    return f"{DATA_DIR}/{rank:05d}-{index:02d}.bin"


@dataclass(frozen=True)
class Location:
    """A checkpoint root on a storage: ``prefix`` is ``""`` or ``"<role>/"``."""

    storage: Storage
    prefix: str
    display: str

    def name(self, generation: int, relative: str) -> str:
        return f"{self.prefix}{generation_dir(generation)}/{relative}"

    def generations(self) -> list[int]:
        found = (_GENERATION.match(n) for n in self.storage.list_dir(self.prefix.rstrip("/")))
        return sorted(int(m.group(1)) for m in found if m)

    def is_committed(self, generation: int) -> bool:
        return self.storage.exists(self.name(generation, COMMIT_MARKER))

    def next_generation(self) -> int:
        existing = self.generations()
        return existing[-1] + 1 if existing else 1

    def latest_committed(self) -> int:
        """The newest committed generation; a clear error when there is none."""
        generations = self.generations()
        for generation in reversed(generations):
            if self.is_committed(generation):
                return generation
        if generations:
            raise CheckpointNotCommittedError(
                f"no committed checkpoint: generation(s) {generations} were started but never committed "
                "(the save failed or was interrupted)", path=self.display)
        if self.storage.exists(self.prefix + MANIFEST) or self.storage.exists(self.prefix + COMMIT_MARKER):
            raise CheckpointNotFoundError(
                "this is a generation folder; pass its parent checkpoint path", path=self.display)
        if not self.storage.exists(self.prefix.rstrip("/")):
            raise CheckpointNotFoundError("no such checkpoint path", path=self.display)
        raise CheckpointNotFoundError("not a bcp checkpoint (no gen-* folders)", path=self.display)

    def commit(self, generation: int, manifest: Manifest) -> None:
        """Write the shard table and the manifest, then the marker that makes the generation visible."""
        manifest_bytes, table_bytes = manifest.encode()
        self.storage.write_file(self.name(generation, SHARD_TABLE), [memoryview(table_bytes)])
        self.storage.write_file(self.name(generation, MANIFEST), [memoryview(manifest_bytes)])
        marker = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "generation": generation,
            "manifest_bytes": len(manifest_bytes), "manifest_crc32c": crc_of(memoryview(manifest_bytes)),
        }
        if not self.storage.put_if_absent(self.name(generation, COMMIT_MARKER), json.dumps(marker).encode()):
            raise CheckpointNotCommittedError(
                f"generation {generation} was committed by another writer", path=self.display)

    def read_manifest_files(self, generation: int) -> tuple[bytes, bytes]:
        """The committed manifest's bytes (checked against the marker) and its shard table's bytes
        (checked when the manifest is parsed)."""
        where = f"{self.display}/{generation_dir(generation)}"
        try:
            marker = json.loads(self.storage.read_bytes(self.name(generation, COMMIT_MARKER)))
            data = self.storage.read_bytes(self.name(generation, MANIFEST))
            table = self.storage.read_bytes(self.name(generation, SHARD_TABLE))
        except FileNotFoundError as exc:
            raise CheckpointNotCommittedError(f"generation is missing {exc.filename or exc}", path=where) from None
        except ValueError:
            raise CorruptCheckpointError("commit marker is not valid JSON", path=where) from None
        if not isinstance(marker, dict) or marker.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError("commit marker is not a bcp marker", path=where)
        if marker.get("manifest_bytes") != len(data) or marker.get("manifest_crc32c") != crc_of(memoryview(data)):
            raise CorruptCheckpointError("manifest does not match the checksum in the commit marker", path=where)
        return data, table

    def read_manifest(self, generation: int) -> Manifest:
        data, table = self.read_manifest_files(generation)
        return Manifest.decode(data, table, path=f"{self.display}/{generation_dir(generation)}")

    def remove_older_than(self, generation: int) -> None:
        for older in self.generations():
            if older < generation:
                self.storage.delete_tree(f"{self.prefix}{generation_dir(older)}")
