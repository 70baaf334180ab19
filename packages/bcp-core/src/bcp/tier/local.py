"""A node's folder of the memory tier: the normal bcp format (``docs/format.md``), one folder per node
under the tier's ``local_dir``. It holds the data files of the node's ranks, the copies it keeps for
peer nodes, the manifest and its own commit marker; one committed generation is kept, plus the one
being written.

Generations are numbered across nodes: a save takes the number after the newest in any node's
folder, so a replaced node's empty folder never makes an older generation look new."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Any

from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, all_agree
from bcp.engine.location import CLAIM, DATA_DIR, MANIFEST, Location, generation_dir
from bcp.errors import CheckpointError, StorageError
from bcp.layout.manifest_files import listed_files
from bcp.layout.markers import Claim
from bcp.layout.references import split_reference
from bcp.storage import LocalStorage
from bcp.wire_records import WireRecord

#: Committed generations a node's folder keeps after a commit (generations being written stay too).
KEEP_GENERATIONS = 1


def node_folder(local_dir: str, node: str) -> str:
    return os.path.join(local_dir, f"node-{node}")


@dataclass(frozen=True)
class NodeLocation(Location):
    """A node's folder as a checkpoint location. Every rank of a save names the tier by the same
    ``identity`` (``target``), whatever its node; ``claimed`` is the generation the tier agreed on
    before planning (its claim's ``token``), handed to the save's planner as its claim."""

    identity: str = ""
    claimed: int = 0
    token: str = ""

    @property
    def target(self) -> str:
        return self.identity

    def claim(self, base: int | None = None) -> tuple[int, str]:
        return self.claimed, self.token

    def may_refer_to(self, file: str) -> bool:
        """An incremental save in the tier refers only to files this node's folder holds, in a
        generation committed there (replication then copies them to peers that lack them)."""
        earlier = split_reference(file)
        return earlier is not None and self.is_committed(earlier[0]) and self.storage.exists(self.prefix + file)


def node_location(local_dir: str, node: str, display: str, identity: str, claimed: int = 0) -> NodeLocation:
    return NodeLocation(LocalStorage(node_folder(local_dir, node)), "", display, KEEP_GENERATIONS, identity,
                        claimed)


def agree_on_generation(coord: Coordinator, location: Location, node_lead: bool,
                        incremental: bool = False) -> tuple[int, str]:
    """Collective: the generation this save writes, after the newest one in any node's folder, and
    its claim's token; each node's lead claims it in its folder (``CLAIM``, create-if-absent). An
    incremental save's claim names its base, the generation committed in the coordinating rank's
    folder (``Location.claim``)."""
    what = f"choosing the generation of {location.display}"

    def newest() -> list[Any]:
        found = max(location.generations(), default=0)
        if coord.rank != 0:
            return [found]
        return [found, secrets.token_hex(8), location.newest_committed() if incremental else None]

    every_rank = all_agree(coord, Outcome.of(newest), what)
    generation = max(found[0] for found in every_rank) + 1
    token, base = every_rank[0][1], every_rank[0][2]

    def claim() -> None:
        if not node_lead:
            return
        try:
            fresh = location.storage.put_if_absent(location.name(generation, CLAIM),
                                                   Claim(token, base, pid=os.getpid()).to_json())
        except OSError as exc:
            raise StorageError(f"cannot claim generation {generation} in the node's folder {location.storage.root}: "
                               f"{exc.strerror or exc}", path=location.display) from exc
        if not fresh:
            raise CheckpointError(f"generation {generation} is already claimed in {location.storage.root}: "
                                  "another job saves to this memory tier at the same time", path=location.display)

    all_agree(coord, Outcome.of(claim), what)
    return generation, token


@dataclass(frozen=True, slots=True)
class Held(WireRecord):
    """One generation in a rank's node folder: committed or not, its data files present (name ->
    size: its own, and when committed those of earlier generations its manifest names) and, when
    committed, the data files its manifest names."""

    generation: int
    committed: bool
    present: dict[str, int]
    needed: list[str]


def census(location: Location) -> list[Held]:
    """What this rank's node folder holds, newest generation first."""
    found = []
    storage = location.storage
    for generation in reversed(location.generations()):
        committed = location.is_committed(generation)
        data = location.name(generation, DATA_DIR)
        present = {f"{DATA_DIR}/{name}": storage.size(f"{data}/{name}") for name in storage.list_dir(data)
                   if name.endswith(".bin")}
        needed = _manifest_files(location, generation) if committed else []
        for name in needed or ():
            if split_reference(name) is not None and storage.exists(location.data_name(generation, name)):
                present[name] = storage.size(location.data_name(generation, name))
        found.append(Held(generation, committed and needed is not None, present, needed or []))
    return found


def _manifest_files(location: Location, generation: int) -> list[str] | None:
    """The data files the committed manifest names (checked again, fully, when it is opened); None
    when the manifest cannot be read (that node's copy of the generation is not used)."""
    try:
        return listed_files(location.storage.read_bytes(location.name(generation, MANIFEST)))
    except OSError:
        return None


def retire_older(location: Location, generation: int, earlier: set[int]) -> None:
    """After ``generation`` committed in this node's folder: remove every older generation but those
    whose data files it lists (``earlier``) and those a newer save in progress may refer to."""
    generations = location.generations()
    in_progress = [g for g in generations if g > generation and not location.is_committed(g)]
    needed = location.needed_earlier([generation], in_progress, {generation: earlier})
    for older in generations if needed is not None else ():
        if older < generation and older not in needed:
            location.storage.delete_tree(f"{location.prefix}{generation_dir(older)}")

