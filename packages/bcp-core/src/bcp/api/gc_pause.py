"""Pausing Python's cyclic garbage collector while a save or load builds its per-tensor records.

Planning a state of thousands of tensors allocates tens of thousands of small containers, which
trigger collections that scan every object of the process (hundreds of thousands once torch is
imported): with the collector running, that scanning cost as much as the planning itself. The
records form no reference cycles, so reference counting frees them; the collector resumes as soon
as the block ends."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused_gc() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
