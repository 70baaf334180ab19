"""The memory tier's steps of the commit barrier (``api.writing.commit_barrier``, the writer door's
own): every rank's report to the coordinating rank, which assembles the manifest; each node's lead
receives it; every rank's files
are replicated to its peers; only once every rank agrees that all writes and copies succeeded does
each node's lead write the manifest and the commit marker into its folder (agree, then mark). Then
each folder keeps only the new generation (and those whose files it lists), and every
``persist_every``-th generation is copied to the persistent checkpoint."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from bcp.api.location import resolve
from bcp.api.metrics import Monitor
from bcp.api.results import PhaseStats
from bcp.api.writing import CommitSteps, RankReport, commit_barrier
from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, all_agree
from bcp.engine.writer import GenerationWriter
from bcp.errors import CheckpointError
from bcp.layout.manifest import Manifest
from bcp.layout.write_report import RankWrites
from bcp.storage import Storage
from bcp.tier.local import retire_older
from bcp.tier.persistence import persist
from bcp.tier.placement import Placement
from bcp.tier.replication import replicate

logger = logging.getLogger("bcp")


@dataclass(frozen=True, slots=True)
class Persistence:
    """Where and how often committed generations are persisted."""

    target: "str | Storage"
    every: int
    role: str | None
    keep_generations: int


@dataclass(frozen=True, slots=True)
class TierCommit:
    """``api.save``'s commit barrier for a memory tier save: the writer door's barrier with the
    tier's steps (:class:`_TierSteps`)."""

    placement: Placement
    persistence: Persistence | None

    def __call__(self, coord: Coordinator, writer: GenerationWriter, report: Outcome,
                 manifest_of: Callable[[list[RankWrites]], Manifest], stats: PhaseStats,
                 monitor: Monitor | None) -> None:
        commit_barrier(coord, writer, report, manifest_of, stats, monitor, _TierSteps(self.placement, self.persistence))


class _TierSteps(CommitSteps):
    """One tier save's steps: the manifest goes to each node's lead, every rank's files are
    replicated, then every node's lead marks the generation committed once every rank agrees;
    then older generations are retired and every ``persist_every``-th one is persisted."""

    noun = "memory tier"

    def __init__(self, placement: Placement, persistence: Persistence | None) -> None:
        self.placement = placement
        self.persistence = persistence
        self.manifest: Manifest | None = None  # on the coordinating rank, once assembled
        self.committed_as: list[Any] = []  # on node leads: the encoded manifest, and the generations it lists files of
        self.own: RankWrites | None = None

    def on_reports(self, coord: Coordinator, writer: GenerationWriter, manifest: Manifest,
                   monitor: Monitor | None) -> list[Any]:
        self.manifest = manifest
        committed = [list(manifest.encode()), sorted(manifest.earlier_generations())]
        return [committed if self.placement.is_node_lead(rank) else None for rank in range(coord.world_size)]

    def after_reply(self, coord: Coordinator, writer: GenerationWriter, reply: Any, own: RankReport,
                    stats: PhaseStats) -> None:
        location, generation = writer.location, writer.generation
        lead = self.placement.is_node_lead(coord.rank)
        self.own, self.committed_as = own.writes, reply or []
        with stats.phase("replicate"):
            stats.received_bytes = replicate(coord, self.placement, location, generation, own.writes.files,
                                             own.writes.earlier_files)
        with stats.phase("commit"):
            all_agree(coord, Outcome.of(lambda: lead and location.commit_encoded(generation, *reply[0])),
                      f"writing the {self.noun} {location.display}")

    def discard(self, coord: Coordinator, writer: GenerationWriter, every_report_in: bool) -> None:
        if self.placement.is_node_lead(coord.rank):  # every rank has stopped writing: the failure reached it in an exchange
            writer.discard()

    def failed_phase(self, committing: bool) -> str | None:
        return None

    def committed(self, coord: Coordinator, writer: GenerationWriter, stats: PhaseStats) -> None:
        location, generation = writer.location, writer.generation
        if self.placement.is_node_lead(coord.rank):
            _retire(location, generation, set(self.committed_as[1]))
        if self.persistence is not None and generation % self.persistence.every == 0:
            with stats.phase("persist"):
                self._persist(coord, location, generation)

    def _persist(self, coord: Coordinator, location: Any, generation: int) -> None:
        p, written = self.persistence, self.own
        assert p is not None and written is not None
        try:
            target = resolve(p.target, p.role, p.keep_generations)
            persist(coord, location, generation, written.files, written.earlier_files, self.manifest, target)
        except CheckpointError as exc:
            raise CheckpointError(f"generation {generation} is committed in the memory tier, but persisting it "
                                  f"failed: {exc}", path=location.display) from exc


def _retire(location: Any, generation: int, earlier: set[int]) -> None:
    """One committed generation per folder (and those whose files it lists); the commit stands
    whatever happens here."""
    try:
        retire_older(location, generation, earlier)
    except OSError as exc:
        logger.warning("bcp: could not remove older generations of the memory tier %s: %s", location.display, exc)
