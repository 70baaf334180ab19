"""``BCPCheckpointIO``: Lightning's checkpoint plugin, backed by bcp.

Lightning calls a CheckpointIO's ``save_checkpoint`` on global rank 0 only and ``load_checkpoint``
on every rank before the optimizers exist, with the checkpoint as a plain dict. That is all it
takes for single-device and DDP training, where every rank holds the whole state: the plugin saves
rank 0's dict and every rank reads it back whole. Sharded training needs every rank and the live
objects; bcp_lightning's strategies call ``save_on_ranks``/``load_into`` for that.

With ``BCPCheckpointIO(memory_tier=bcp.MemoryTier(...))`` the checkpoint path
``bcp_lightning.MEMORY_TIER`` names that tier (``Trainer.save_checkpoint(MEMORY_TIER)``,
``trainer.fit(ckpt_path=MEMORY_TIER)``; ``bcp_lightning.MemoryTierCheckpoint`` saves to it every few
steps): a tier is saved and loaded by every rank, so beyond one process it takes bcp_lightning's
strategies.

Asynchronous saving is the plugin's own mode (``async_save=True``): the state is staged in host
memory on the calling thread and committed in the background in call order, so removals and loads
are ordered after the saves before them. Under Lightning's ``AsyncCheckpointIO`` wrapper the plugin
saves on the wrapper's thread; a save counts as pending from the moment it starts, so a removal or a
load on the training thread waits for it.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import bcp
from bcp.integration import default_coordinator
from bcp_lightning import convert, lightning_patch, loader_states, options, paths, targets, torch_files
from bcp_lightning.options import DEFAULT_IO_THREADS, DEFAULT_KEEP_GENERATIONS, Options
from bcp_lightning.pending import PendingSaves
from bcp_lightning.targets import Target


class CheckpointIOMixin:
    """Saves Lightning checkpoints as bcp checkpoints (a directory at the checkpoint path).

    ``Trainer(plugins=[BCPCheckpointIO()])`` is enough for single-device and DDP training; the
    checkpoint's model weights load into any layout (``bcp.load``, bcp_lightning's strategies).
    For resharding optimizer state and for FSDP or ModelParallel training, use bcp_lightning's
    strategies: Lightning's FSDPStrategy and ModelParallelStrategy bypass checkpoint plugins.

    A single-file checkpoint written by Lightning's default ``TorchCheckpointIO`` loads too (with
    ``torch.load(weights_only=True)``), so a run can switch to bcp when it resumes.

    ``keep_generations=N`` keeps the N newest committed generations of a path saved again
    (``last.ckpt``); ``load_generation=G`` makes the loads through this plugin (``ckpt_path=``
    resumes) read the kept generation G instead of the newest: a roll-back after a loss spike.
    ``incremental=True`` writes, at each save of a path saved again (``last.ckpt``, a memory tier),
    only the tensors whose bytes changed since its previous generation (``docs/incremental.md``).

    ``memory_tier``: a ``bcp.MemoryTier`` that the checkpoint path ``bcp_lightning.MEMORY_TIER``
    names (node memory, replicated to peer nodes, persisted every few saves).

    ``compression="zstd"`` (or ``True``) compresses the tensors' bytes losslessly, each checksum chunk
    on its own, on the writer threads (``bcp.SaveOptions.compression``); loads read either kind.

    ``overlap=True`` (with ``async_save=True``): a save returns before the parameters and optimizer
    state are copied to host memory, and the fit's optimizers wait for the copy before they step
    (``bcp.SaveOptions.overlap``); with ``MemoryTierCheckpoint(every_n_train_steps=1)``, a snapshot
    of every step. Code that writes parameters outside ``optimizer.step()`` (an EMA into the model)
    calls the plugin's ``wait_snapshot()`` first.

    ``last_load`` is the ``bcp.LoadResult`` of the newest load through this plugin (for a memory
    tier, its ``source`` says whether node memory or the persistent copy was read, and why).
    """

    #: The fits that checkpoint through this plugin have their train loaders followed (``loader_states``).
    bcp_follows_train_loaders = True

    def __init__(self, *, async_save: bool = False, allow_pickle: bool = False, verify: bool = True,
                 verify_replicas: bool = False, io_threads: int = DEFAULT_IO_THREADS,
                 keep_generations: int = DEFAULT_KEEP_GENERATIONS, load_generation: int | None = None,
                 memory_tier: "bcp.MemoryTier | None" = None, incremental: bool = False,
                 overlap: bool = False, compression: "bcp.Compression | str | bool | None" = None) -> None:
        super().__init__()
        if memory_tier is not None and not targets.is_tier(memory_tier):
            raise TypeError(f"memory_tier takes a bcp.MemoryTier, got {type(memory_tier).__name__}")
        self.memory_tier = memory_tier
        self.options = Options.of(async_save=async_save, allow_pickle=allow_pickle, verify=verify,
                                  verify_replicas=verify_replicas, io_threads=io_threads,
                                  keep_generations=keep_generations, load_generation=load_generation,
                                  incremental=incremental, overlap=overlap, compression=compression)
        self._pending = PendingSaves()
        self.last_load: bcp.LoadResult | None = None
        loader_states.install()  # shuffled train loaders: follow their draws from the first fit on

    # Lightning's CheckpointIO interface.

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save Lightning's checkpoint dict from this rank alone (Lightning calls it on rank 0).
        ``storage_options`` override this plugin's options for this save: see ``options.STORAGE_OPTION_TYPES``."""
        _refuse_tier_from_one_rank(self._target(path), "saved")
        self.save_on_ranks(checkpoint, path, bcp.SingleProcessCoordinator(), storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's checkpoint dict, every tensor whole on the CPU (each calling rank reads it all).
        A single-file checkpoint of Lightning's ``TorchCheckpointIO`` is read with
        ``torch.load(weights_only=True)`` whatever ``weights_only`` says."""
        if map_location is not None:
            raise TypeError("BCPCheckpointIO.load_checkpoint loads tensors on the CPU; map_location is not "
                            "supported, move the loaded tensors instead")
        location = self._before_load(path)
        _refuse_tier_from_one_rank(location, "loaded")
        if isinstance(location, str) and paths.is_single_file(location):
            if self.options.load.generation is not None:
                raise bcp.CheckpointNotFoundError(
                    f"load_generation={self.options.load.generation} asks for a kept generation, but this is a "
                    "single-file checkpoint of Lightning's TorchCheckpointIO, which keeps none", path=location)
            return torch_files.load(location)
        single = bcp.SingleProcessCoordinator()
        rest, layout = self._read_metadata(location, single, weights_only)
        loaded = convert.templates(layout)
        loaded.update(loader_states.template(layout.get(loader_states.COMPONENT, False), single))
        if loaded:
            self._load(location, loaded, single, strict=True, weights_only=weights_only)
        loader_states.put_back(rest, loaded)
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

    def save_on_ranks(self, checkpoint: Mapping[str, Any], path: Any, coordinator: bcp.Coordinator | None = None,
                      *, storage_options: Any | None = None, topology: Mapping[str, int] | None = None) -> None:
        """Save Lightning's checkpoint dict; every rank of ``coordinator`` (default: the world) calls
        it with its own dict, whose state may be sharded (DTensors, FSDP1 shards). ``topology``: the
        rank's parallel coordinates for the metrics record (default: its rank in the group as ``dp``)."""
        location = self._target(path)
        opts = options.for_save(self.options.save, storage_options, targets.name(location))
        coordinator = coordinator or default_coordinator()
        pending = self._pending.start(targets.name(location))
        handle = None
        try:
            if coordinator.rank == 0 and isinstance(location, str):
                # Other ranks touch the path only after rank 0 has planned the save, so no barrier is needed.
                paths.prepare_for_save(location)
            handle = bcp.save(location, _components(checkpoint, coordinator), opts, coordinator=coordinator,
                              topology=_topology(opts, topology, coordinator), step=_global_step(checkpoint),
                              overlap_optimizers=self._fit_optimizers() if opts.overlap else ())
        finally:
            pending.returned(handle)
        self._pending.reap()

    def load_into(self, path: Any, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]], *,
                  strict: bool = True, coordinator: bcp.Coordinator | None = None,
                  topology: Mapping[str, int] | None = None) -> dict[str, Any]:
        """Load into live state dicts on every rank: ``model_state`` and the FQN-keyed
        ``optimizer_states`` (none when not resuming training) are filled in place, resharded into
        their layout; ``topology`` as for ``save_on_ranks``. Returns Lightning's other entries; it keeps
        index-keyed ``optimizer_states`` when the checkpoint has only those (saved under Lightning's own
        DDP strategy): the caller decides."""
        location = self._before_load(path)
        if isinstance(location, str) and paths.is_single_file(location):
            raise bcp.CheckpointNotFoundError(
                "this is a single-file checkpoint of Lightning's TorchCheckpointIO, which bcp_lightning's strategies "
                "do not load (they load sharded state in place); resume it once with Lightning's own strategy and "
                "plugins=[BCPCheckpointIO()], which reads it, then save through bcp", path=location)
        coordinator = coordinator or default_coordinator()
        rest, layout = self._read_metadata(location, coordinator, None)
        state = {convert.MODEL: convert.model_view(model_state)}
        state.update(loader_states.template(layout.get(loader_states.COMPONENT, False), coordinator))
        if optimizer_states:
            if convert.OPTIMIZER_STATES in layout:
                state[convert.OPTIMIZER] = convert.optimizer_view(optimizer_states)
            elif convert.OPTIMIZER_STATES not in rest:
                raise bcp.CheckpointError(
                    "the checkpoint holds no optimizer state (saved with weights_only=True?); training cannot "
                    "resume from it, only evaluate", path=targets.name(location))
        self._load(location, state, coordinator, strict=strict, weights_only=None, topology=topology)
        convert.write_back(model_state, state[convert.MODEL])
        if convert.OPTIMIZER in state:
            convert.write_back_optimizers(optimizer_states, state[convert.OPTIMIZER])
        loader_states.put_back(rest, state)
        return rest

    def wait_snapshot(self) -> None:
        """Block until the pending saves' copies of the state are complete, so that the state may
        change: at once unless they overlap their copy with training (``overlap``). The fit's
        optimizers wait for it themselves; call it on the training thread before writing parameters
        or optimizer state otherwise."""
        self._pending.wait_snapshots()

    def wait(self, path: str | None = None) -> None:
        """Block until pending saves (to ``path``, or all) are committed; raise the first failure."""
        self._pending.wait(path)

    # Internals.

    def _target(self, path: Any) -> Target:
        return targets.of(path, self.memory_tier)

    def _fit_optimizers(self) -> tuple[Any, ...]:
        """The torch optimizers of the fit checkpointing through this plugin: Lightning's dict holds
        their state, and they wait for an overlapped save's copy before they step. None where no
        fit is followed (``loader_states``): the save then copies everything at the call."""
        trainer = loader_states.followed_trainer()
        if trainer is None or trainer.strategy.checkpoint_io is not self:
            return ()
        return tuple(lightning_patch.torch_optimizer(optimizer) for optimizer in trainer.strategy.optimizers)

    def _before_load(self, path: Any) -> Target:
        self.wait()
        location = self._target(path)
        if isinstance(location, str):
            paths.check_loadable(location)
        return location

    def _read_metadata(self, location: Target, coordinator: bcp.Coordinator,
                       weights_only: bool | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Lightning's plain entries and the layout record, read before any tensor."""
        meta: dict[str, Any] = {convert.REST: None, convert.LAYOUT: None}
        # A step of the load that follows, not an operation of its own: no metrics record.
        result = self._load(location, meta, coordinator, strict=False, weights_only=weights_only, recorded=False)
        if result.missing:
            raise bcp.CheckpointError(
                f"not a Lightning checkpoint saved by bcp_lightning (no {convert.REST!r} component); load it "
                "with bcp.load into your LightningModule and optimizer instead", path=targets.name(location))
        convert.check_layout(meta[convert.LAYOUT], targets.name(location))
        return meta[convert.REST], meta[convert.LAYOUT]

    def _load(self, location: Target, state: dict[str, Any], coordinator: bcp.Coordinator, *, strict: bool,
              weights_only: bool | None, topology: Mapping[str, int] | None = None,
              recorded: bool = True) -> bcp.LoadResult:
        opts = self.options.load
        result = bcp.load(location, state, opts, strict=strict, coordinator=coordinator,
                          topology=_topology(opts, topology, coordinator),
                          metrics_log=opts.metrics_log if recorded else False,
                          allow_pickle=opts.allow_pickle and weights_only is not True)
        if recorded:
            self.last_load = result
        return result


def _global_step(checkpoint: Mapping[str, Any]) -> int | None:
    """Lightning's ``global_step`` (optimizer steps taken), recorded as the generation's step."""
    step = checkpoint.get("global_step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _topology(opts: "bcp.SaveOptions | bcp.LoadOptions", topology: Mapping[str, int] | None,
              coordinator: bcp.Coordinator) -> Mapping[str, int]:
    """The coordinates the user set, else the strategy's, else the rank in the checkpoint's group as DP."""
    return opts.topology or topology or {"dp": coordinator.rank}


def _components(checkpoint: Mapping[str, Any], coordinator: bcp.Coordinator) -> dict[str, Any]:
    """The bcp components of Lightning's checkpoint dict, the fit loop's dataloader states among them."""
    components = convert.split(checkpoint)
    components[convert.REST], loaders = loader_states.take_out(components[convert.REST], coordinator)
    components.update(loaders)
    components[convert.LAYOUT][loader_states.COMPONENT] = bool(loaders)
    return components


def _refuse_tier_from_one_rank(target: Target, done: str) -> None:
    """A memory tier spans the ranks of the job; Lightning's own strategies call a plugin on rank 0
    alone (saves) or on each rank alone (loads)."""
    import torch.distributed as dist

    if targets.is_tier(target) and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise bcp.CheckpointError(
            f"a memory tier is {done} by every rank together, and this plugin is being called by one rank alone "
            "(Lightning's own strategies do that): use bcp_lightning's BCPDDPStrategy, BCPFSDPStrategy or "
            "BCPModelParallelStrategy with a memory tier", path=targets.name(target))
