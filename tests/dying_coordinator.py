"""A real coordinator whose process kills itself (SIGKILL) at a chosen exchange: a rank dying at an
exact point of a save. Used by the peer-death tests of both coordinators."""

from __future__ import annotations

import os
import signal

import bcp


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Dying:
    """The real coordinator, except that its process kills itself on its ``die_at``-th exchange;
    its sibling (an asynchronous save's background channel) dies at ``background`` (an exchange
    number, or "sibling" to die while the sibling is being set up)."""

    def __init__(self, inner: bcp.Coordinator, die_at: int | None, background: int | str | None = None) -> None:
        self.inner, self.die_at, self.background = inner, die_at, background
        self.rank, self.world_size = inner.rank, inner.world_size
        self.exchanges = 0

    def sibling(self) -> "Dying":
        if self.background == "sibling":
            die()
        return Dying(self.inner.sibling(), self.background if isinstance(self.background, int) else None)

    def cache_key(self) -> object:
        return self.inner.cache_key()

    def process_group(self) -> object:
        return self.inner.process_group()

    def _exchange(self, method: str, message):
        self.exchanges += 1
        if self.exchanges == self.die_at:
            die()
        return getattr(self.inner, method)(message)

    def all_gather_bytes(self, data):
        return self._exchange("all_gather_bytes", data)

    def gather_bytes(self, data):
        return self._exchange("gather_bytes", data)

    def scatter_bytes(self, parts):
        return self._exchange("scatter_bytes", parts)

    def broadcast_bytes(self, data):
        return self._exchange("broadcast_bytes", data)


def reap(procs: list) -> list:
    """Each process's exit code once it ended (30 s each at most); one still running is killed."""
    for p in procs:
        p.join(timeout=30)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return codes
