"""The writer door: every rank writes its share of a generation, the coordinating rank assembles the
manifest from every rank's report and commits it. ``bcp.save`` and the tools that write checkpoints
(``convert``, ``edit``, ``export`` to bcp) all write through it.

The commit barrier (:func:`commit_barrier`) is one for every kind of save: every rank's
:class:`RankReport` to the coordinating rank, the manifest assembled there, the verdict on every
rank, and what was written discarded on a failure. What a kind of save does at each step is its
:class:`CommitSteps`: the writer door's commit the manifest at once; a memory tier's hand it to
each node's lead, replicate, agree, then mark (``tier.commit``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from bcp.api.gc_pause import paused_gc
from bcp.api.metrics import Monitor
from bcp.api.metrics_log import prune_records
from bcp.api.results import PhaseStats
from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, gather_then_reply
from bcp.wire_records import WireRecord
from bcp.engine.writer import GenerationWriter
from bcp.errors import CheckpointError
from bcp.layout.manifest import Manifest
from bcp.layout.write_plan import PieceWrite, ValueWrite
from bcp.layout.write_report import RankWrites

logger = logging.getLogger("bcp")


@dataclass(frozen=True, slots=True)
class RankReport(WireRecord):
    """A rank's word at the commit barrier: where everything it wrote lies, and its metrics record (None without a monitor)."""

    NESTED = {"writes": RankWrites.from_wire}
    writes: RankWrites
    metrics: list[Any] | None = None


class CommitSteps:
    """What a kind of save does at the steps of the commit barrier; these are the writer door's."""

    #: What is written, in the errors of the barrier's exchange.
    noun = "checkpoint"

    def on_reports(self, coord: Coordinator, writer: GenerationWriter, manifest: Manifest,
                   monitor: Monitor | None) -> list[Any]:
        """On the coordinating rank, every rank's report in and none failed: commit the manifest;
        what each rank is told."""
        oldest_kept = writer.commit(manifest)
        if monitor is not None and monitor.metrics_log is True and oldest_kept is not None:
            _prune_log(writer, oldest_kept)  # within the commit: its requests count in this save's record
        return [None] * coord.world_size

    def after_reply(self, coord: Coordinator, writer: GenerationWriter, reply: Any, own: RankReport,
                    stats: PhaseStats) -> None:
        """On every rank, with the coordinating rank's ``reply``: what commits after the exchange."""

    def discard(self, coord: Coordinator, writer: GenerationWriter, every_report_in: bool) -> None:
        """The save failed (on any rank): remove what was written of the generation."""
        if coord.rank == 0:  # the failure reached it in the exchange, or the exchange failed
            writer.discard(every_writer_stopped=every_report_in)

    def failed_phase(self, committing: bool) -> str | None:
        """The phase a failure is recorded in (None: the phase that was running)."""
        return "commit" if committing else "write"

    def committed(self, coord: Coordinator, writer: GenerationWriter, stats: PhaseStats) -> None:
        """On every rank, once the generation is committed (its failures do not undo that)."""


def write_generation(coord: Coordinator, writer: GenerationWriter, pieces: Sequence[PieceWrite],
                     values: Sequence[ValueWrite], manifest_of: Callable[[list[RankWrites]], Manifest],
                     stats: PhaseStats, on_written: Callable[[int], None] | None = None,
                     monitor: Monitor | None = None) -> None:
    """Collective. Write this rank's ``pieces`` and ``values``; the coordinating rank then builds the
    manifest with ``manifest_of(every rank's report)`` and commits it. A failure on any rank is
    raised on every rank, and what was written of the (claimed, uncommitted) generation is removed.
    With a ``monitor``, each rank's metrics record travels with its report and the coordinating rank
    finishes the operation's record. An asynchronous save runs the two halves, :func:`write_share`
    and :func:`commit_generation`, on separate threads."""
    commit_generation(coord, writer, write_share(coord.rank, writer, pieces, values, stats, on_written, monitor),
                      manifest_of, stats, monitor)


def write_share(rank: int, writer: GenerationWriter, pieces: Sequence[PieceWrite], values: Sequence[ValueWrite],
                stats: PhaseStats, on_written: Callable[[int], None] | None = None,
                monitor: Monitor | None = None, on_report: Callable[[RankWrites], None] | None = None) -> Outcome:
    """Not collective. Write this rank's share; once it returns the data is durable (and staged
    buffers are free). Returns this rank's :class:`RankReport` (as plain data) for the commit
    barrier: where everything lies, or the error that stopped the writes (reported to every rank
    there, not raised here). ``on_report`` completes the report before it leaves (an incremental
    save adds the pieces it did not write)."""
    def write() -> RankWrites:
        report = writer.write_rank(rank, pieces, values, on_written)
        if on_report is not None:
            on_report(report)
        return report

    with stats.phase("write"):
        written = Outcome.of(write)
    stats.bytes = written.value.nbytes if written.error is None else 0
    stats.value_bytes = sum(value.nbytes for value in written.value.values) if written.error is None else 0
    return Outcome(RankReport(written.value, monitor.rank_wire() if monitor else None).to_wire()
                   if written.error is None else None, written.error)


def commit_generation(coord: Coordinator, writer: GenerationWriter, report: Outcome,
                      manifest_of: Callable[[list[RankWrites]], Manifest], stats: PhaseStats,
                      monitor: Monitor | None = None) -> None:
    """Collective: the writer door's commit barrier (:func:`commit_barrier` with its own steps)."""
    commit_barrier(coord, writer, report, manifest_of, stats, monitor, CommitSteps())


def commit_barrier(coord: Coordinator, writer: GenerationWriter, report: Outcome,
                   manifest_of: Callable[[list[RankWrites]], Manifest], stats: PhaseStats,
                   monitor: Monitor | None, steps: CommitSteps) -> None:
    """Collective: the integrity barrier. Every rank's ``report`` travels to the coordinating rank,
    which assembles the manifest once it holds all of them and none failed (``steps.on_reports``
    then commits it, or hands it on); each rank returns once it has the verdict, and raises where
    the generation was not committed (the previous one stays the latest, and ``steps.discard``
    removes what was written)."""
    committing = False
    every_report_in = False  # on the coordinating rank: every rank's writes have ended
    records: list[Any] = []

    def reported() -> None:
        nonlocal every_report_in
        every_report_in = True

    def on_every_report(every_rank: list[Any]) -> list[Any]:
        nonlocal committing
        committing = True
        reports = [RankReport.from_wire(wire) for wire in every_rank]
        records.extend(rank.metrics for rank in reports)
        with paused_gc():  # on the background thread of an async save, the foreground's pause is over
            manifest = manifest_of([rank.writes for rank in reports])
        return steps.on_reports(coord, writer, manifest, monitor)

    try:
        with stats.phase("commit"):
            reply = gather_then_reply(coord, report, on_every_report,
                                      f"writing the {steps.noun} {writer.location.display}", reported)
        steps.after_reply(coord, writer, reply, RankReport.from_wire(report.value), stats)
    except BaseException as exc:
        steps.discard(coord, writer, every_report_in)
        if monitor:  # before the commit, the exchange carried the failures of the ranks' writes
            monitor.fail(steps.failed_phase(committing), exc)
        raise
    steps.committed(coord, writer, stats)
    if monitor and coord.rank == 0:
        monitor.finish(records)


def _prune_log(writer: GenerationWriter, oldest_kept: int) -> None:
    """The metrics log follows the retention just applied; the commit stands whatever happens here."""
    try:
        prune_records(writer.location, oldest_kept)
    except (OSError, CheckpointError) as exc:
        logger.warning("bcp: could not prune the metrics log of %s: %s", writer.location.display, exc)
