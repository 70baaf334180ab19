"""Where one rank's time and bytes went in a save or a load, phase by phase.

The phases of an operation follow one another and cover it; a phase may be broken down into parts,
named ``<phase>.<part>`` (the load's ``plan.state``, ``plan.staging``, ``plan.reads``), which lie
within it and cover it in turn.

Every time of an operation is read from one clock: the monotonic one, placed on the epoch once per
operation (a span that paired a wall-clock reading with a monotonic one would put a part past its
phase's end by as long as the thread was preempted between the two reads, or by a step of the wall
clock)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator


def _epoch_offset() -> float:
    """Where the monotonic clock stands on the epoch: of three readings of the wall clock, the one
    whose monotonic readings on either side lie closest (a thread preempted between them would
    misplace the operation on the epoch; its spans still nest, being read from one clock)."""
    readings = []
    for _ in range(3):
        before = time.perf_counter()
        wall = time.time()
        after = time.perf_counter()
        readings.append((after - before, wall - (before + after) / 2))
    return min(readings)[1]


@dataclass
class PhaseStats:
    """Seconds per phase and bytes moved on this rank (save: collect, plan, stage, write, commit;
    load: metadata, plan, read, agree, apply), with the parts of a phase broken down."""

    seconds: dict[str, float] = field(default_factory=dict)
    #: Bytes written (save) or read from storage (load) by this rank.
    bytes: int = 0
    #: Of ``bytes``, those of values (the rest are tensors' bytes).
    value_bytes: int = 0
    #: Incremental save: bytes of this rank's pieces not written because an earlier generation stores them.
    reused_bytes: int = 0
    #: Load with ``read_once``: bytes this rank received from other ranks instead of reading them.
    received_bytes: int = 0
    #: Each phase as run: (name, start, end) in seconds since the epoch, for timelines across ranks.
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    #: The phase that was running when the operation failed (the first one an error escaped from).
    failed_phase: str | None = None
    #: Seconds to add to ``time.perf_counter()`` for seconds since the epoch, fixed for the operation.
    epoch_offset: float = field(default_factory=_epoch_offset, repr=False, compare=False)

    def now(self) -> float:
        """Seconds since the epoch on the operation's clock, which never goes back (every time of the
        operation, its start and end included, is read here, in any thread)."""
        return time.perf_counter() + self.epoch_offset

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self.now()
        try:
            yield
        except BaseException:
            if not is_part(name):  # a failure in a part is its phase's
                self.failed_phase = self.failed_phase or name
            raise
        finally:
            self.add(name, start, self.now())

    def add(self, name: str, start: float, end: float) -> None:
        """A phase from ``start`` to ``end``, read from :meth:`now` (in any thread: the wait from a
        hand-off to the thread that runs the next phase)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + (end - start)
        self.spans.append((name, start, end))


def is_part(name: str) -> bool:
    """Whether ``name`` is a part of a phase (``plan.reads``), not a phase of its own."""
    return "." in name
