"""What a forked child (a DataLoader worker, a checkpoint process) does with the coordination its
parent held: nothing. The child inherits the objects but not the threads behind them (gloo's, gRPC's),
so closing, shutting down or destroying them there would join threads that do not exist. Each
registry of live coordination objects is emptied in the child, its objects kept aside, unused, for
the child's whole life; the child makes its own if it ever coordinates."""

from __future__ import annotations

import os
from collections.abc import MutableMapping, MutableSet
from typing import Any

# Kept referenced so that the child never finalizes them either.
_inherited: list[Any] = []


def left_alone_in_forked_children(registry: "MutableMapping[Any, Any] | MutableSet[Any]") -> None:
    """Empty ``registry`` (a dict's values or a set's members are what it holds) in every child
    forked from now on, keeping its objects untouched. The child runs this alone, right after the
    fork: no lock is taken (one held by another thread at the fork would never be released there)."""

    def forget() -> None:
        _inherited.extend(registry.values() if isinstance(registry, MutableMapping) else registry)
        registry.clear()

    os.register_at_fork(after_in_child=forget)
