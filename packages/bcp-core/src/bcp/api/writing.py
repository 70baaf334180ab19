"""The writer door: every rank writes its share of a generation, the coordinating rank assembles the
manifest from every rank's report and commits it. ``bcp.save`` and the tools that write checkpoints
(``convert``, ``edit``, ``export`` to bcp) all write through it."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from bcp.api.gc_pause import paused_gc
from bcp.api.metrics import Monitor
from bcp.api.metrics_log import prune_records
from bcp.api.results import PhaseStats
from bcp.coord import Coordinator
from bcp.coord.consensus import Outcome, gather_then_reply
from bcp.engine.writer import GenerationWriter
from bcp.errors import CheckpointError
from bcp.layout.manifest import Manifest
from bcp.layout.write_plan import PieceWrite, ValueWrite
from bcp.layout.write_report import RankWrites

logger = logging.getLogger("bcp")


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
    buffers are free). Returns this rank's report for :func:`commit_generation`: where everything
    lies, or the error that stopped the writes (reported to every rank there, not raised here).
    ``on_report`` completes the report before it leaves (an incremental save adds the pieces it
    did not write)."""
    def write() -> RankWrites:
        report = writer.write_rank(rank, pieces, values, on_written)
        if on_report is not None:
            on_report(report)
        return report

    with stats.phase("write"):
        written = Outcome.of(write)
    stats.bytes = written.value.nbytes if written.error is None else 0
    stats.value_bytes = sum(value.nbytes for value in written.value.values) if written.error is None else 0
    return Outcome([written.value.to_wire(), monitor.rank_wire() if monitor else None]
                   if written.error is None else None, written.error)


def commit_generation(coord: Coordinator, writer: GenerationWriter, report: Outcome,
                      manifest_of: Callable[[list[RankWrites]], Manifest], stats: PhaseStats,
                      monitor: Monitor | None = None) -> None:
    """Collective: the integrity barrier. Every rank's ``report`` travels to the coordinating rank,
    which commits once it holds all of them and none failed; each rank returns once it has the
    verdict, and raises where the generation was not committed (the previous one stays the latest)."""
    committing = False
    every_report_in = False  # on the coordinating rank: every rank's writes have ended
    records: list[Any] = []

    def reported() -> None:
        nonlocal every_report_in
        every_report_in = True

    try:
        def commit(every_rank: list[Any]) -> list[None]:
            nonlocal committing
            committing = True
            records.extend(record for _, record in every_rank)
            with paused_gc():  # on the background thread of an async save, the foreground's pause is over
                manifest = manifest_of([RankWrites.from_wire(wire) for wire, _ in every_rank])
            oldest_kept = writer.commit(manifest)
            if monitor is not None and monitor.metrics_log is True and oldest_kept is not None:
                _prune_log(writer, oldest_kept)  # within the commit: its requests count in this save's record
            return [None] * coord.world_size

        with stats.phase("commit"):
            gather_then_reply(coord, report, commit, f"writing the checkpoint {writer.location.display}", reported)
    except BaseException as exc:
        if coord.rank == 0:  # the failure reached it in the exchange, or the exchange failed
            writer.discard(every_writer_stopped=every_report_in)
            if monitor:  # before the commit, the exchange carried the failures of the ranks' writes
                monitor.fail("commit" if committing else "write", exc)
        raise
    if monitor and coord.rank == 0:
        monitor.finish(records)


def _prune_log(writer: GenerationWriter, oldest_kept: int) -> None:
    """The metrics log follows the retention just applied; the commit stands whatever happens here."""
    try:
        prune_records(writer.location, oldest_kept)
    except (OSError, CheckpointError) as exc:
        logger.warning("bcp: could not prune the metrics log of %s: %s", writer.location.display, exc)
