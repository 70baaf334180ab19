"""Progress reporting for the long-running tools: a one-line bar on a terminal, nothing elsewhere
(logs and pipes get only the tools' results)."""

from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO

from bcp.tools.units import human_bytes


class Progress(Protocol):
    """Receives the work done, in bytes."""

    def start(self, label: str, total: int) -> None: ...

    def advance(self, amount: int) -> None: ...

    def finish(self) -> None: ...


class NoProgress:
    def start(self, label: str, total: int) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def finish(self) -> None:
        pass


class TerminalProgress:
    """A bar redrawn in place at most ``rate`` times a second and erased by ``finish``."""

    WIDTH = 30

    def __init__(self, stream: TextIO, rate: float = 10.0) -> None:
        self.stream = stream
        self.interval = 1.0 / rate
        self.label, self.total, self.done, self.drawn_at = "", 0, 0, 0.0

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.drawn_at = label, total, 0, 0.0
        self._draw()

    def advance(self, amount: int) -> None:
        self.done += amount
        if time.monotonic() - self.drawn_at >= self.interval or self.done >= self.total:
            self._draw()

    def finish(self) -> None:
        self.stream.write("\r\033[K")
        self.stream.flush()

    def _draw(self) -> None:
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(fraction * self.WIDTH)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(f"\r\033[K{self.label} [{bar}] {fraction:4.0%} "
                          f"{human_bytes(self.done)} / {human_bytes(self.total)}")
        self.stream.flush()
        self.drawn_at = time.monotonic()


def progress_for(stream: TextIO | None = None) -> Progress:
    """A terminal bar when ``stream`` (default: stderr) is a terminal, else silence."""
    stream = stream if stream is not None else sys.stderr
    return TerminalProgress(stream) if stream.isatty() else NoProgress()
