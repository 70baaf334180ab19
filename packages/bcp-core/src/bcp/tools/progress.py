"""Progress reporting for the long-running tools: tqdm's one-line bar (bytes/s, time left) on a
terminal, nothing elsewhere (logs and pipes get only the tools' results) or with ``--quiet``."""

from __future__ import annotations

import sys
from typing import Protocol, TextIO

from tqdm import tqdm


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
    """tqdm's bar on a terminal: bytes done of the total, bytes per second and the time left, redrawn
    in place and erased by ``finish``."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._bar: tqdm | None = None

    def start(self, label: str, total: int) -> None:
        self.finish()
        self._bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=self.stream,
                         leave=False, dynamic_ncols=True, mininterval=0.1)

    def advance(self, amount: int) -> None:
        if self._bar is not None:
            self._bar.update(amount)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def progress_for(stream: TextIO | None = None, *, quiet: bool = False) -> Progress:
    """A terminal bar when ``stream`` (default: stderr) is a terminal, else (or when ``quiet``) silence."""
    stream = stream if stream is not None else sys.stderr
    return TerminalProgress(stream) if stream.isatty() and not quiet else NoProgress()
