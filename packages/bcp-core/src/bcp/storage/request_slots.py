"""A cap on the requests one process keeps in flight to one object store, shared by all its files
and threads: a counting semaphore whose holders may take several slots at once (a ranged read
that fetches several pieces in parallel takes one slot per piece)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class RequestSlots:
    """At most ``limit`` requests at once; :meth:`take` waits for free slots."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_requests={limit}: at least one request must be allowed in flight")
        self.limit = limit
        self._free = limit
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def take(self, count: int = 1) -> Iterator[None]:
        """Hold ``count`` slots (at most ``limit``) while the block runs; all or none are taken, so
        two holders waiting for more can never deadlock on a partial share."""
        count = min(max(count, 1), self.limit)
        with self._changed:
            self._changed.wait_for(lambda: self._free >= count)
            self._free -= count
        try:
            yield
        finally:
            with self._changed:
                self._free += count
                self._changed.notify_all()
