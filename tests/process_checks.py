"""Checks on processes a test did not start itself (bcp's writer process)."""

from __future__ import annotations

import os
import time


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` has ended (or ends within ``within_s`` seconds)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
