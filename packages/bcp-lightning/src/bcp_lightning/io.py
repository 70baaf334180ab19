"""``BCPCheckpointIO``: Lightning's checkpoint plugin, backed by bcp.

Lightning calls a CheckpointIO's ``save_checkpoint`` on global rank 0 only and ``load_checkpoint``
on every rank before the optimizers exist, with the checkpoint as a plain dict. That is all it
takes for single-device and DDP training, where every rank holds the whole state: the plugin saves
rank 0's dict and every rank reads it back whole. Sharded training needs every rank and the live
objects; bcp_lightning's strategies call ``save_on_ranks``/``load_into`` for that.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from typing import Any, Mapping

import bcp
from bcp.integration import default_coordinator
from bcp_lightning import convert, paths

DEFAULT_IO_THREADS = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """How the plugin calls ``bcp.save``/``bcp.load``."""

    async_save: bool = False
    """Return from a save once bcp has staged it in host memory; it commits in the background, in
    call order. Pending saves are waited for before a load, before their path is removed, at
    teardown and at exit."""
    allow_pickle: bool = False
    """Let values outside bcp's safe encoding (in callbacks' or hyper-parameters' state) be pickled,
    and such checkpoints be loaded. Off: those values fail at save time, naming the entry."""
    verify: bool = True
    """Check every byte read against its checksum."""
    verify_replicas: bool = False
    """At save, check by checksum that tensors replicated across ranks are identical."""
    io_threads: int = DEFAULT_IO_THREADS
    """Threads per rank reading or writing data files."""


class CheckpointIOMixin:
    """Saves Lightning checkpoints as bcp checkpoints (a directory at the checkpoint path).

    ``Trainer(plugins=[BCPCheckpointIO()])`` is enough for single-device and DDP training; the
    checkpoint's model weights load into any layout (``bcp.load``, bcp_lightning's strategies).
    For resharding optimizer state and for FSDP or ModelParallel training, use bcp_lightning's
    strategies: Lightning's FSDPStrategy and ModelParallelStrategy bypass checkpoint plugins.
    """

    def __init__(self, *, async_save: bool = False, allow_pickle: bool = False, verify: bool = True,
                 verify_replicas: bool = False, io_threads: int = DEFAULT_IO_THREADS) -> None:
        super().__init__()
        self.options = Options(async_save=async_save, allow_pickle=allow_pickle, verify=verify,
                               verify_replicas=verify_replicas, io_threads=io_threads)
        self._pending: dict[str, list[bcp.SaveHandle]] = {}
        self._waits_at_exit = False

    # Lightning's CheckpointIO interface.

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save Lightning's checkpoint dict from this rank alone (Lightning calls it on rank 0)."""
        refuse_storage_options(storage_options)
        self.save_on_ranks(checkpoint, path, bcp.SingleProcessCoordinator())

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's checkpoint dict, every tensor whole on the CPU (each calling rank reads it all)."""
        if map_location is not None:
            raise TypeError("BCPCheckpointIO.load_checkpoint loads tensors on the CPU; map_location is not "
                            "supported, move the loaded tensors instead")
        location = self._before_load(path)
        single = bcp.SingleProcessCoordinator()
        rest, layout = self._read_metadata(location, single, weights_only)
        loaded = convert.templates(layout)
        if loaded:
            self._load(location, loaded, single, strict=True, weights_only=weights_only)
        return convert.join(rest, layout, loaded)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` once any pending save to it has committed."""
        location = os.fspath(path)
        self.wait(location)
        paths.remove(location)

    def teardown(self) -> None:
        """Wait for every pending save (Lightning calls this when a run ends)."""
        self.wait()

    # What bcp_lightning's strategies call on every rank.

    def save_on_ranks(self, checkpoint: Mapping[str, Any], path: Any,
                      coordinator: bcp.Coordinator | None = None) -> None:
        """Save Lightning's checkpoint dict; every rank of ``coordinator`` (default: the world) calls
        it with its own dict, whose state may be sharded (DTensors, ShardedTensors)."""
        location = os.fspath(path)
        coordinator = coordinator or default_coordinator()
        if coordinator.rank == 0:
            # Other ranks touch the path only after rank 0 has planned the save, so no barrier is needed.
            paths.prepare_for_save(location)
        opts = self.options
        handle = bcp.save(location, convert.split(checkpoint), async_save=opts.async_save,
                          coordinator=coordinator, allow_pickle=opts.allow_pickle,
                          verify_replicas=opts.verify_replicas, io_threads=opts.io_threads)
        self._track(location, handle)

    def load_into(self, path: Any, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]], *,
                  strict: bool = True, coordinator: bcp.Coordinator | None = None) -> dict[str, Any]:
        """Load into live state dicts on every rank: ``model_state`` and the FQN-keyed
        ``optimizer_states`` (none when not resuming training) are filled in place, resharded into
        their layout. Returns Lightning's other entries; it keeps index-keyed ``optimizer_states`` when
        the checkpoint has only those (saved under Lightning's own DDP strategy): the caller decides."""
        location = self._before_load(path)
        coordinator = coordinator or default_coordinator()
        rest, layout = self._read_metadata(location, coordinator, None)
        state = {convert.MODEL: convert.model_view(model_state)}
        if optimizer_states:
            if convert.OPTIMIZER_STATES in layout:
                state[convert.OPTIMIZER] = convert.optimizer_view(optimizer_states)
            elif convert.OPTIMIZER_STATES not in rest:
                raise bcp.CheckpointError(
                    "the checkpoint holds no optimizer state (saved with weights_only=True?); training cannot "
                    "resume from it, only evaluate", path=location)
        self._load(location, state, coordinator, strict=strict, weights_only=None)
        convert.write_back(model_state, state[convert.MODEL])
        if convert.OPTIMIZER in state:
            convert.write_back_optimizers(optimizer_states, state[convert.OPTIMIZER])
        return rest

    def wait(self, path: str | None = None) -> None:
        """Block until pending saves (to ``path``, or all) are committed; raise the first failure."""
        for location in [path] if path is not None else list(self._pending):
            for handle in self._pending.pop(location, []):
                handle.wait()

    # Internals.

    def _track(self, location: str, handle: bcp.SaveHandle) -> None:
        # Finished saves are dropped here, so a failed one raises at the next save, not only at teardown.
        for other in list(self._pending):
            for done in [h for h in self._pending[other] if h.done()]:
                self._pending[other].remove(done)
                done.wait()
            if not self._pending[other]:
                del self._pending[other]
        if handle.done():
            return
        self._pending.setdefault(location, []).append(handle)
        if not self._waits_at_exit:
            atexit.register(self.wait)
            self._waits_at_exit = True

    def _before_load(self, path: Any) -> str:
        self.wait()
        location = os.fspath(path)
        paths.check_loadable(location)
        return location

    def _read_metadata(self, location: str, coordinator: bcp.Coordinator,
                       weights_only: bool | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Lightning's plain entries and the layout record, read before any tensor."""
        meta: dict[str, Any] = {convert.REST: None, convert.LAYOUT: None}
        result = self._load(location, meta, coordinator, strict=False, weights_only=weights_only)
        if result.missing:
            raise bcp.CheckpointError(
                f"not a Lightning checkpoint saved by bcp_lightning (no {convert.REST!r} component); load it "
                "with bcp.load into your LightningModule and optimizer instead", path=location)
        convert.check_layout(meta[convert.LAYOUT], location)
        return meta[convert.REST], meta[convert.LAYOUT]

    def _load(self, location: str, state: dict[str, Any], coordinator: bcp.Coordinator, *, strict: bool,
              weights_only: bool | None) -> bcp.LoadResult:
        opts = self.options
        return bcp.load(location, state, strict=strict, coordinator=coordinator,
                        allow_pickle=opts.allow_pickle and weights_only is not True,
                        verify=opts.verify, io_threads=opts.io_threads)


def refuse_storage_options(storage_options: Any | None) -> None:
    if storage_options is not None:
        raise TypeError("bcp_lightning does not take storage_options; configure saving on BCPCheckpointIO(...) "
                        "and pass remote storage as the checkpoint path")
