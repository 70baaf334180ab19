"""What ``save`` and ``load`` return: a handle on the save, a report of the load, and their stats."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bcp.api.phase_stats import PhaseStats

if TYPE_CHECKING:
    from bcp.api.metrics import Monitor, OpRecord
    from bcp.engine.snapshot_copy import SnapshotCopy

__all__ = ["LoadResult", "PhaseStats", "SaveHandle"]


class SaveHandle:
    """A save in progress or done. ``wait()`` returns once the checkpoint is committed."""

    def __init__(self, path: str, generation: int, stats: PhaseStats, future: "Future | None" = None,
                 monitor: "Monitor | None" = None, snapshot: "SnapshotCopy | None" = None) -> None:
        self.path = path
        self.generation = generation
        #: Per-phase seconds and bytes written by this rank; complete once ``wait()`` returned.
        self.stats = stats
        self._future = future
        self._monitor = monitor
        self._snapshot = snapshot

    @property
    def metrics(self) -> "OpRecord | None":
        """On the coordinating rank, once committed (or failed): every rank's timings, bytes and
        place in the topology; None on the other ranks and before."""
        return self._monitor.record if self._monitor is not None else None

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed and raise the save's error if it failed; a synchronous save is
        committed when ``save`` returns."""
        if self._future is not None:
            self._future.result(timeout)

    def wait_snapshot(self) -> None:
        """Block until the save's copy of the state is complete, so that the state may change: at
        once unless the save overlaps its copy with training (``overlap``). The state's optimizers
        wait for it themselves; code that writes parameters or optimizer state otherwise (an
        in-place update outside ``optimizer.step()``, a weight tie, EMA into the model) calls it
        first, on the training thread. A failed copy is raised by ``wait()``, not here."""
        if self._snapshot is not None:
            self._snapshot.finish()

    def done(self) -> bool:
        return self._future is None or self._future.done()


@dataclass
class LoadResult:
    """What a ``load`` did on this rank. ``loaded``, ``missing`` and ``unexpected`` say what was and
    was not loaded on both sides, as torch's ``load_state_dict(strict=False)`` lists
    ``missing_keys`` and ``unexpected_keys``."""

    path: str
    generation: int
    saved_world_size: int
    saved_framework: str
    #: The saved names this rank loaded.
    loaded: list[str] = field(default_factory=list)
    #: Names this rank asked for that the checkpoint lacks (``strict`` refuses any).
    missing: list[str] = field(default_factory=list)
    #: Saved names that no rank loaded, sorted: those of a component the state names (``strict``
    #: refuses any) and every name of a component it does not name (a whole optimizer left in the
    #: checkpoint). The same on every rank.
    unexpected: list[str] = field(default_factory=list)
    #: Per-rank entries this rank did not save itself (it is beyond the saved world size, or saved
    #: none): it received rank 0's value, or the first saving rank's where rank 0 saved none.
    from_rank0: list[str] = field(default_factory=list)
    #: Per-rank values that, the world size having changed, some loading ranks received from rank 0
    #: (by name: those ranks); values every saved rank held identical are not listed
    #: (``docs/resharding.md``, per-rank values).
    duplicated: dict[str, list[int]] = field(default_factory=dict)
    #: Per-rank values of saved ranks beyond the loading world size that no rank loaded (by name: the
    #: saved ranks); values identical to a loaded one are not listed.
    dropped: dict[str, list[int]] = field(default_factory=dict)
    stats: PhaseStats = field(default_factory=PhaseStats)
    #: Which tier the load read: ``"memory"`` (a ``bcp.MemoryTier``'s node-local copies) or
    #: ``"persistent"`` (a checkpoint on storage; every load from a path).
    source: str = "persistent"
    #: Why that tier, in words (a ``bcp.MemoryTier`` load: which generation, what was missing); empty
    #: for a load from a path.
    source_reason: str = ""
    #: On the coordinating rank: every rank's timings, bytes and place in the topology; else None.
    metrics: "OpRecord | None" = None
