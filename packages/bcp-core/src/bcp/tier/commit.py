"""The memory tier's commit barrier, in place of the writer door's: every rank's report to the
coordinating rank, which assembles the manifest; each node's lead receives it; every rank's files
are replicated to its peers; only once every rank agrees that all writes and copies succeeded does
each node's lead write the manifest and the commit marker into its folder (agree, then mark). Then
each folder keeps only the new generation (and those whose files it lists), and every
``persist_every``-th generation is copied to the persistent checkpoint."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from bcp.api.gc_pause import paused_gc
from bcp.api.location import resolve
from bcp.api.metrics import Monitor
from bcp.api.results import PhaseStats
from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, all_agree, gather_then_reply
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
    """``api.save``'s commit barrier for a memory tier save."""

    placement: Placement
    persistence: Persistence | None

    def __call__(self, coord: Coordinator, writer: GenerationWriter, report: Outcome,
                 manifest_of: Callable[[list[RankWrites]], Manifest], stats: PhaseStats,
                 monitor: Monitor | None) -> None:
        location, generation = writer.location, writer.generation
        lead = self.placement.is_node_lead(coord.rank)
        what = f"writing the memory tier {location.display}"
        built: list[Manifest] = []
        records: list[Any] = []

        def assemble(every_rank: list[Any]) -> list[Any]:
            records.extend(record for _, record in every_rank)
            with paused_gc():
                built.append(manifest_of([RankWrites.from_wire(wire) for wire, _ in every_rank]))
            committed = [list(built[0].encode()), sorted(built[0].earlier_generations())]
            return [committed if self.placement.is_node_lead(rank) else None for rank in range(coord.world_size)]

        try:
            with stats.phase("commit"):
                committed = gather_then_reply(coord, report, assemble, what)
            written = RankWrites.from_wire(report.value[0])
            own_files = written.files
            with stats.phase("replicate"):
                stats.received_bytes = replicate(coord, self.placement, location, generation, own_files,
                                                 written.earlier_files)
            with stats.phase("commit"):
                all_agree(coord, Outcome.of(lambda: lead and location.commit_encoded(generation, *committed[0])), what)
        except BaseException as exc:
            if lead:  # every rank has stopped writing: the failure reached it in an exchange
                writer.discard()
            if monitor is not None:
                monitor.fail(None, exc)
            raise
        if lead:
            _retire(location, generation, set(committed[1]))
        if self.persistence is not None and generation % self.persistence.every == 0:
            with stats.phase("persist"):
                self._persist(coord, location, generation, written, built[0] if built else None)
        if monitor is not None and coord.rank == 0:
            monitor.finish(records)

    def _persist(self, coord: Coordinator, location: Any, generation: int, written: RankWrites,
                 manifest: Manifest | None) -> None:
        p = self.persistence
        assert p is not None
        try:
            target = resolve(p.target, p.role, p.keep_generations)
            persist(coord, location, generation, written.files, written.earlier_files, manifest, target)
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
