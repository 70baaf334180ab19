"""Replication: once every rank's files of a generation are written in its node's folder, each
rank's files are copied into the folders of its ``Placement.receivers`` (other nodes), over the
coordinator's process group, and so are the files of earlier generations an incremental save
refers to, to the receivers whose folders lack them (a replaced node's). The generation is marked
committed in any folder only after every rank's writes and copies succeeded (``tier.commit``)."""

from __future__ import annotations

import os
from typing import Any, Iterator

from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, all_agree
from bcp.engine.location import DATA_DIR, Location
from bcp.errors import StorageError
from bcp.layout.references import generation_dir
from bcp.tier.placement import Placement
from bcp.tier.transfer import Transfer, run_transfers


def replicate(coord: Coordinator, placement: Placement, location: Location, generation: int,
              own_files: list[str], earlier_files: list[str] = ()) -> int:
    """Collective: every rank's ``own_files`` (written in its node folder) into its receivers'
    folders, and the files of earlier generations it refers to (``earlier_files``, which its folder
    holds) into those of its receivers' folders that do not hold them already. Returns the bytes
    this rank received; a failure anywhere raises on every rank."""
    what = f"replicating generation {generation} of {location.display}"

    def sizes() -> list[Any]:
        return [[[name, os.path.getsize(_path(location, generation, name))] for name in own_files],
                [[name, os.path.getsize(_path(location, generation, name))] for name in earlier_files],
                _earlier_held(location, generation)]

    every_rank = all_agree(coord, Outcome.of(sizes), what)
    transfers = []
    sent: set[tuple[str, str]] = set()  # an earlier file goes to each node's folder once, whoever refers to it
    for sender, (own, earlier, _) in enumerate(every_rank):
        for receiver in placement.receivers(sender):
            transfers += [Transfer(sender, receiver, name, 0, size) for name, size in own]
            for name, size in earlier:
                copy = (placement.nodes[receiver], name)
                if every_rank[receiver][2].get(name) != size and copy not in sent:
                    sent.add(copy)
                    transfers.append(Transfer(sender, receiver, name, 0, size))

    def read(transfer: Transfer, start: int, into: memoryview) -> None:
        location.storage.read_into(location.data_name(generation, transfer.name), start, into)

    def received(transfer: Transfer, chunks: Iterator[memoryview]) -> None:
        try:
            location.storage.write_file(location.data_name(generation, transfer.name), chunks)
        except OSError as exc:
            raise StorageError(f"writing the copy of {transfer.name} (rank {transfer.sender}) failed: {exc}",
                               path=location.display) from exc

    moved = Outcome.of(lambda: run_transfers(coord, transfers, read, received))
    all_agree(coord, Outcome(None, moved.error), what)
    return moved.value


def _earlier_held(location: Location, generation: int) -> dict[str, int]:
    """The data files of earlier generations this rank's node folder holds, named from the folder."""
    held = {}
    for earlier in location.generations():
        folder = location.name(earlier, DATA_DIR) if earlier < generation else None
        for name in location.storage.list_dir(folder) if folder else ():
            held[f"{generation_dir(earlier)}/{DATA_DIR}/{name}"] = location.storage.size(f"{folder}/{name}")
    return held


def _path(location: Location, generation: int, name: str) -> str:
    return os.path.join(location.storage.root, location.data_name(generation, name))
