"""Persistence: a committed generation of the memory tier copied to the persistent checkpoint and
committed there, from the node folders' files (not staged again from the live state). Each rank
copies the data files it wrote, and the files of earlier tier generations that an incremental save
refers to (each by the lowest rank referring to it); the coordinating rank commits the manifest,
naming those copies inside the new generation, once every rank's copy is durable. The persistent
generation refers to nothing else: an ordinary bcp checkpoint that ``bcp.load(path, ...)`` loads."""

from __future__ import annotations

import os
from typing import Iterator

from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, all_agree, broadcast_from_root, gather_then_reply
from bcp.engine.location import Location
from bcp.errors import StorageError
from bcp.layout.manifest import Manifest
from bcp.layout.references import copied_name

COPY_CHUNK_BYTES = 16 << 20


def persist(coord: Coordinator, local: Location, generation: int, files: list[str], earlier_files: list[str],
            manifest: Manifest | None, target: Location) -> int:
    """Collective: copy generation ``generation`` of this rank's node folder (its own data ``files``,
    and the ``earlier_files`` it refers to) to a new generation of ``target`` and commit it there
    (``manifest``: on the coordinating rank). Returns the persistent generation; a failure raises on
    every rank and removes what was copied."""
    what = f"persisting generation {generation} of {local.display} to {target.display}"
    claimed = broadcast_from_root(coord, Outcome.of(target.claim_next_generation) if coord.rank == 0 else Outcome(),
                                  what)
    referring = all_agree(coord, Outcome(earlier_files), what)
    first = {}
    for rank, names in enumerate(referring):
        for name in names:
            first.setdefault(name, rank)
    mine = [name for name in earlier_files if first[name] == coord.rank]

    def copy() -> None:
        for name in [*files, *mine]:
            source = os.path.join(local.storage.root, local.data_name(generation, name))
            try:
                target.storage.write_file(target.name(claimed, copied_name(name)), _chunks_of(source))
            except OSError as exc:
                raise StorageError(f"copying {name} of generation {generation} failed: {exc}",
                                   path=target.display) from exc

    def commit(_: list) -> list[None]:
        assert manifest is not None
        target.commit(claimed, manifest.copied_as(claimed))
        target.apply_retention(claimed)
        return [None] * coord.world_size

    try:
        gather_then_reply(coord, Outcome.of(copy), commit, what)
    except BaseException:
        if coord.rank == 0:
            target.discard(claimed)
        raise
    return claimed


def _chunks_of(path: str) -> Iterator[memoryview]:
    with open(path, "rb", buffering=0) as file:
        while chunk := file.read(COPY_CHUNK_BYTES):
            yield memoryview(chunk)
