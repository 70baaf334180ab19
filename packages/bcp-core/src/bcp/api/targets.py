"""Checkpoint targets other than one path: objects that ``bcp.save`` and ``bcp.load`` accept where
they accept a path (``bcp.MemoryTier``), so that every integration forwarding a path forwards them
too. Such an object decides itself where a save goes and where a load reads from."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from bcp.api.options import LoadOptions, SaveOptions
from bcp.api.results import LoadResult, SaveHandle


@runtime_checkable
class CheckpointTarget(Protocol):
    """Where ``bcp.save`` writes and ``bcp.load`` reads when it is given this object as the path."""

    def save_state(self, state: Mapping[str, Any], options: SaveOptions) -> SaveHandle:
        """Collective: save ``state`` as ``bcp.save`` would (its options already merged)."""

    def load_wanted(self, want: Callable[..., Any], options: LoadOptions) -> LoadResult:
        """Collective: read what ``want`` (an ``api.load.Want``) names, as
        ``bcp.integration.load_wanted`` would."""
