"""What a process's recent saves stored, for its incremental saves (``planning.reuse``): per
checkpoint and coordinator channel, the boxes each save stored and how it saw each tensor then, and
the claims its coordinating rank made (a base whose claim is one of them is a save this memory
describes). Held by the Runtime; a load forgets it all."""

from __future__ import annotations

import threading
from typing import Any

from bcp.planning.reuse import Key, Remembered


class ReuseMemory:
    """What this process's recent saves stored, per checkpoint and channel (``place``), with how it
    saw each tensor then; and the claims its coordinating rank made. Held by the Runtime. A load
    forgets everything: it writes into live tensors without moving their version counters."""

    #: Generations remembered per place: the base of the next save, and asynchronous saves in flight.
    KEEP = 3
    #: Places remembered (the most recently saved): saves to a new path each time (top-k checkpoints)
    #: would otherwise add one each, for as long as the process runs.
    PLACES = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = 0
        self._saved: dict[Any, dict[int, dict[Key, Remembered]]] = {}
        self._claims: dict[str, dict[int, str]] = {}

    @property
    def epoch(self) -> int:
        """Changes at each :meth:`forget`: a save remembers what it saw only if none came between."""
        return self._epoch

    def remember(self, place: Any, generation: int, boxes: dict[Key, Remembered], epoch: int) -> None:
        with self._lock:
            if epoch != self._epoch:
                return
            saved = self._saved.pop(place, {})
            self._saved[place] = saved  # the most recent place last
            saved[generation] = boxes
            for old in sorted(saved)[:-self.KEEP]:
                del saved[old]
            for old in list(self._saved)[:-self.PLACES]:
                del self._saved[old]

    def recalled(self, place: Any, generation: int) -> dict[Key, Remembered] | None:
        with self._lock:
            return self._saved.get(place, {}).get(generation)

    def generations(self, place: Any) -> list[int]:
        with self._lock:
            return sorted(self._saved.get(place, {}))

    def claimed(self, target: str, generation: int, token: str) -> None:
        with self._lock:
            claims = self._claims.pop(target, {})
            self._claims[target] = claims
            claims[generation] = token
            for old in sorted(claims)[:-self.KEEP]:
                del claims[old]
            for old in list(self._claims)[:-self.PLACES]:
                del self._claims[old]

    def claim_token(self, target: str, generation: int) -> str | None:
        with self._lock:
            return self._claims.get(target, {}).get(generation)

    def forget(self) -> None:
        with self._lock:
            self._epoch += 1
            self._saved.clear()
            self._claims.clear()

