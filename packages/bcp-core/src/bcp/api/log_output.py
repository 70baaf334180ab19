"""Where the ``bcp`` logger's lines go when the program has set up no logging of its own.

Python prints a library's records without any configuration only from WARNING up (its "last
resort" handler), so ``logging.getLogger("bcp").setLevel(logging.INFO)`` alone would show no
summary line. The handler here prints ``bcp`` records to stderr at the ``bcp`` logger's own level,
but only while no handler of the program's would receive them: once the program configures
logging (``logging.basicConfig``, a handler on ``bcp`` or on the root logger, pytest's capture),
records go there alone and are never printed twice."""

from __future__ import annotations

import logging
import sys


class StderrUntilConfigured(logging.StreamHandler):
    """Prints a record to the current ``sys.stderr`` unless another handler on its way up receives it."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property  # type: ignore[override]
    def stream(self):  # the current stderr, as Python's last-resort handler does (it may be replaced)
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass

    def handle(self, record: logging.LogRecord) -> bool:
        if self._others_receive(record):
            return False
        return bool(super().handle(record))

    def _others_receive(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self and record.levelno >= h.level for h in logger.handlers):
                return True
            logger = logger.parent if logger.propagate else None
        return False


def install(logger: logging.Logger) -> None:
    """Give ``logger`` the fallback handler, once."""
    if not any(isinstance(h, StderrUntilConfigured) for h in logger.handlers):
        logger.addHandler(StderrUntilConfigured())
