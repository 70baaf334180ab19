"""Where one rank's time and bytes went in a save or a load, phase by phase.

The phases of an operation follow one another and cover it; a phase may be broken down into parts,
named ``<phase>.<part>`` (the load's ``plan.state``, ``plan.staging``, ``plan.reads``), which lie
within it and cover it in turn."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator


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

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        wall, start = time.time(), time.perf_counter()
        try:
            yield
        except BaseException:
            if not is_part(name):  # a failure in a part is its phase's
                self.failed_phase = self.failed_phase or name
            raise
        finally:
            elapsed = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
            self.spans.append((name, wall, wall + elapsed))

    def add(self, name: str, start: float, end: float) -> None:
        """A phase timed across threads (``start`` and ``end`` in seconds since the epoch): the wait
        from a hand-off to the thread that runs the next phase."""
        self.seconds[name] = self.seconds.get(name, 0.0) + (end - start)
        self.spans.append((name, start, end))


def is_part(name: str) -> bool:
    """Whether ``name`` is a part of a phase (``plan.reads``), not a phase of its own."""
    return "." in name
