"""Overlapped snapshot copies held back on their thread, for the integrations' every-step tests: an
optimizer step that did not wait for the copy would then surely run before it."""

from __future__ import annotations

import threading
import time

import pytest

from bcp.engine import snapshot_copy

#: Far longer than a step of the tests' small models (a few ms).
HELD_BACK_S = 0.3


def hold_back_copies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on (until the test ends) each overlapped copy sleeps before it copies; returns the
    names of the threads that did, one per copy."""
    held: list[str] = []

    def hold_back() -> None:
        assert threading.current_thread() is not threading.main_thread()
        held.append(threading.current_thread().name)
        time.sleep(HELD_BACK_S)

    monkeypatch.setattr(snapshot_copy, "BEFORE_COPY", hold_back)
    return held
