"""What a load's apply changed, taken back when the load fails on any rank.

Applying writes in two tiers: contents (staged bytes placed into live tensors, tensors and
containers filled in place) and objects (adapters and ``Stateful`` objects given their loaded state). Each
change records how to take it back as it is made. Taking back runs the contents tier first, then the
object tier, each newest first: an object given its previous state dict back may copy from tensors
whose previous bytes must be in place by then (a ``state_dict()`` that returns copies).
"""

from __future__ import annotations

from typing import Callable

Step = Callable[[], None]


class Undo:
    """The steps that take back an apply, recorded as its changes are made."""

    __slots__ = ("_bytes", "_objects")

    def __init__(self) -> None:
        self._bytes: list[Step] = []
        self._objects: list[Step] = []

    def on_contents(self, step: Step) -> None:
        """Record how to give a live tensor or container back the bytes or items it held (run before
        every object step)."""
        self._bytes.append(step)

    def on_object(self, step: Step) -> None:
        """Record how to give an object back the state it had."""
        self._objects.append(step)

    def run(self, error: BaseException) -> None:
        """Take back everything recorded, contents first, newest first in each tier. A step that fails
        is noted on ``error`` (the load's failure) and the others still run."""
        steps = [*reversed(self._bytes), *reversed(self._objects)]
        self._bytes, self._objects = [], []
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - every other step must still run
                error.add_note(f"taking back the failed load's changes also failed: {type(exc).__name__}: {exc}")
