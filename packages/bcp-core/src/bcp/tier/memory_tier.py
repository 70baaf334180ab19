"""``bcp.MemoryTier``: checkpoints in node memory, copied to peer nodes, recovered without storage
(into the same or a smaller layout), persisted to storage every k-th save. ``docs/memory-tier.md``."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from dataclasses import KW_ONLY, dataclass
from typing import Any, Mapping, Sequence

from bcp.api.load import Want, load_from, load_wanted
from bcp.api.location import resolve
from bcp.api.options import LoadOptions, SaveOptions
from bcp.api.results import LoadResult, SaveHandle
from bcp.api.save import save_at
from bcp.chunk_codecs import Compression
from bcp.coord import Coordinator, as_coordinator
from bcp.coord.consensus import Outcome, all_agree
from bcp.engine.shared_memory import mapped_files_available
from bcp.errors import CheckpointError, CheckpointNotCommittedError, CheckpointNotFoundError
from bcp.storage import LocalStorage, Storage, is_url
from bcp.tier.commit import Persistence, TierCommit
from bcp.tier.file_staging import InGenerationFiles
from bcp.tier.local import Held, NodeLocation, agree_on_generation, census, node_folder
from bcp.tier.peer_source import PeerSource
from bcp.tier.placement import Placement, launcher_node, node_of, split_shared_hosts
from bcp.tier.recovery import choose

logger = logging.getLogger("bcp")

#: Where the node-local folders live by default: memory that survives a process restart.
SHM = "/dev/shm"
DEFAULT_PERSIST_EVERY = 10


@dataclass(frozen=True)
class MemoryTier:
    """A checkpoint target for ``bcp.save`` / ``bcp.load`` (and every integration that forwards a
    path): each save goes to a node-local folder (``local_dir``, default under ``/dev/shm``),
    its files copied to ``replicas`` other nodes; a load reads the newest generation complete across
    the live nodes (a replaced node's ranks fetch from peers, a smaller job reads the survivors'
    folders), else the ``persistent`` checkpoint, where every ``persist_every``-th save is copied.

    ``persistent``: a path, URL or Storage (None: memory only). ``nodes``: the node id of each rank
    (default: ``BCP_NODE``, else the host name, told apart by torchrun's node rank where several
    launcher nodes share a host). ``name``: the folder under ``/dev/shm`` when
    ``local_dir`` is not given (default: derived from ``persistent``). ``compression``: the codec of
    every save to the tier that does not name one (``bcp.save(..., compression=...)``; a save that
    passes ``compression=False`` is uncompressed); the compressed files are replicated and persisted
    as they are. Picklable."""

    persistent: "str | os.PathLike | Storage | None" = None
    _: KW_ONLY
    local_dir: "str | os.PathLike | None" = None
    persist_every: int = DEFAULT_PERSIST_EVERY
    replicas: int = 1
    nodes: Sequence[str] | None = None
    name: str | None = None
    compression: "Compression | str | bool | None" = None

    def __post_init__(self) -> None:
        if type(self.persist_every) is not int or self.persist_every < 1:
            raise CheckpointError(f"MemoryTier(persist_every=...) must be an integer >= 1, not {self.persist_every!r}")
        if type(self.replicas) is not int or self.replicas < 0:
            raise CheckpointError(f"MemoryTier(replicas=...) must be an integer >= 0, not {self.replicas!r}")
        if self.nodes is not None:
            object.__setattr__(self, "nodes", tuple(self.nodes))
        try:
            Compression.of(self.compression)
        except ValueError as exc:
            raise CheckpointError(f"MemoryTier(compression=...): {exc}") from None

    @property
    def folder(self) -> str:
        """The folder holding each node's folder (``node-<id>/``) on that node."""
        if self.local_dir is not None:
            return os.path.abspath(os.fspath(self.local_dir))
        if not os.path.isdir(SHM):
            raise CheckpointError(f"{SHM} does not exist on this machine: pass MemoryTier(local_dir=...) a "
                                  "node-local folder (a RAM disk or a local SSD)")
        return os.path.join(SHM, "bcp-tier", self.name or _name_of(self.persistent))

    @property
    def display(self) -> str:
        return f"memory tier {self.folder}"

    def save_state(self, state: Mapping[str, Any], options: SaveOptions) -> SaveHandle:
        if options.compression is None and self.compression is not None:  # False: named "none"
            options = dataclasses.replace(options, compression=self.compression)
        coord = as_coordinator(options.coordinator)
        placement = Placement.of(self._nodes(coord), self.replicas)
        lead = placement.is_node_lead(coord.rank)
        folder = self._node_location(placement.nodes[coord.rank], options.role)

        def locate() -> NodeLocation:
            claimed, token = agree_on_generation(coord, folder, lead, options.incremental)
            return dataclasses.replace(folder, claimed=claimed, token=token)

        persistence = None if self.persistent is None else \
            Persistence(self.persistent, self.persist_every, options.role, options.keep_generations)
        # A compressed save's files are written by the writer door, which compresses what was staged.
        in_place = mapped_files_available() and not getattr(options, "compression", None)
        stage_in = InGenerationFiles if in_place else None
        return save_at(self.display, locate, state, _no_log_beside(options), TierCommit(placement, persistence),
                       stage_in)

    def load_wanted(self, want: Want, options: LoadOptions) -> LoadResult:
        if options.generation is not None:
            raise CheckpointError("a memory tier keeps one generation: load an older one from the persistent "
                                  "checkpoint", path=self.display)
        coord = as_coordinator(options.coordinator)
        nodes = tuple(self._nodes(coord))
        folder = self._node_location(nodes[coord.rank], options.role)
        every_rank = all_agree(coord, Outcome.of(lambda: [held.to_wire() for held in census(folder)]),
                               f"finding the newest complete generation of {self.display}")
        choice = choose([[Held.from_wire(w) for w in rows] for rows in every_rank], nodes)
        if choice.generation is not None:
            source = PeerSource(folder, choice, self.display)
            result = load_from(source, want, _no_log_beside(options))
            result.source = "memory"
            result.source_reason = (f"loaded from the {self.display}: {choice.reason} (this rank fetched "
                                    f"{source.fetched} bytes from peers)")
            result.stats.received_bytes += source.fetched
        else:
            result = self._load_persistent(want, options, choice.reason)
        if coord.rank == 0:
            logger.info("bcp: %s", result.source_reason)
        return result

    def _load_persistent(self, want: Want, options: LoadOptions, why: str) -> LoadResult:
        if self.persistent is None:
            raise CheckpointNotFoundError(f"nothing to load: {why}, and the tier has no persistent checkpoint",
                                          path=self.display)
        try:
            result = load_wanted(self.persistent, want, options)
        except (CheckpointNotFoundError, CheckpointNotCommittedError) as exc:
            raise type(exc)(f"nothing to load: {why}; the persistent checkpoint: {exc}", path=self.display) from exc
        result.source = "persistent"
        result.source_reason = (f"the {self.display} cannot be used ({why}): loaded generation {result.generation} "
                                f"of the persistent checkpoint {result.path}")
        return result

    def _nodes(self, coord: Coordinator) -> list[str]:
        """Every rank's node id (collective where they come from each rank's host)."""
        if self.nodes is not None:
            return [node_of(rank, coord.world_size, self.nodes) for rank in range(coord.world_size)]
        found = all_agree(coord, Outcome.of(lambda: [node_of(coord.rank, coord.world_size, None), launcher_node()]),
                          f"finding the nodes of {self.display}")
        return split_shared_hosts([(node, group) for node, group in found])

    def _node_location(self, node: str, role: str | None) -> NodeLocation:
        base = resolve(LocalStorage(node_folder(self.folder, node)), role)
        return NodeLocation(base.storage, base.prefix, self.display, 1, identity=f"memory-tier:{self.folder}")


def _name_of(persistent: Any) -> str:
    """A folder name for the tier of ``persistent``: the same on every node naming it."""
    if persistent is None:
        return "default"
    if isinstance(persistent, Storage):
        target = persistent.root
    else:
        text = os.fspath(persistent)
        target = text if is_url(text) else os.path.abspath(text)
    return hashlib.blake2b(target.encode(), digest_size=8).hexdigest()


def _no_log_beside(options: Any) -> Any:
    """A tier keeps no metrics log beside its node folders (it would outlive their generations);
    a metrics log file named by the caller is kept."""
    return dataclasses.replace(options, metrics_log=False) if options.metrics_log is True else options
