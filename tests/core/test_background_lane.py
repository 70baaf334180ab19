"""The background lane lets go of a job before its handle resolves: a caller woken by the handle
finds nothing of the save referenced by bcp's threads (its coordinator, and through it a process
group the caller may have destroyed, whose sockets torch closes when the last reference goes).
Guards a race where the commit thread still held the job's callables for a moment after the
handle's wait() returned, so a count of open sockets taken then depended on thread scheduling."""

from __future__ import annotations

import threading
import weakref

from bcp.engine.background import BackgroundLane


class Held:
    """Stands for what a save's callables hold (its coordinator, its process group)."""


class Step:
    def __init__(self, held: Held, gate: threading.Event | None = None) -> None:
        self.held, self.gate = held, gate

    def __call__(self, *_: object) -> None:
        if self.gate is not None:
            assert self.gate.wait(30)


def test_a_jobs_callables_are_released_before_its_handle_resolves():
    lane = BackgroundLane()
    held, gate = Held(), threading.Event()
    ref = weakref.ref(held)
    done = lane.submit(Step(held, gate), Step(held))
    del held
    alive_when_resolved = []
    # Runs in the thread that resolves the handle, as it resolves it: the moment a waiter wakes.
    done.add_done_callback(lambda _: alive_when_resolved.append(ref() is not None))
    gate.set()
    assert done.exception(30) is None
    assert alive_when_resolved == [False]
    lane.close()
