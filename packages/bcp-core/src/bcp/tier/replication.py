"""Replication: once every rank's files of a generation are written in its node's folder, each
rank's files are copied into the folders of its ``Placement.receivers`` (other nodes), over the
coordinator's process group. The generation is marked committed in any folder only after every
rank's writes and copies succeeded (``tier.commit``)."""

from __future__ import annotations

import os
from typing import Iterator

from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, all_agree
from bcp.engine.location import Location
from bcp.errors import StorageError
from bcp.tier.placement import Placement
from bcp.tier.transfer import Transfer, run_transfers


def replicate(coord: Coordinator, placement: Placement, location: Location, generation: int,
              own_files: list[str]) -> int:
    """Collective: every rank's ``own_files`` (written in its node folder) into its receivers'
    folders. Returns the bytes this rank received; a failure anywhere raises on every rank."""
    what = f"replicating generation {generation} of {location.display}"

    def sizes() -> list[list]:
        return [[name, os.path.getsize(_path(location, generation, name))] for name in own_files]

    every_rank = all_agree(coord, Outcome.of(sizes), what)
    transfers = [Transfer(sender, receiver, name, 0, size)
                 for sender, files in enumerate(every_rank)
                 for receiver in placement.receivers(sender)
                 for name, size in files]

    def read(transfer: Transfer, start: int, into: memoryview) -> None:
        location.storage.read_into(location.name(generation, transfer.name), start, into)

    def received(transfer: Transfer, chunks: Iterator[memoryview]) -> None:
        try:
            location.storage.write_file(location.name(generation, transfer.name), chunks)
        except OSError as exc:
            raise StorageError(f"writing the copy of {transfer.name} (rank {transfer.sender}) failed: {exc}",
                               path=location.display) from exc

    moved = Outcome.of(lambda: run_transfers(coord, transfers, read, received))
    all_agree(coord, Outcome(None, moved.error), what)
    return moved.value


def _path(location: Location, generation: int, name: str) -> str:
    return os.path.join(location.storage.root, location.name(generation, name))
