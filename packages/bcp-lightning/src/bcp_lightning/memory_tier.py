"""Frequent checkpoints into bcp's memory tier during a fit, resumed as any checkpoint is.

``Trainer(plugins=[BCPCheckpointIO(memory_tier=tier)], callbacks=[MemoryTierCheckpoint(every_n_train_steps=k)])``
calls ``Trainer.save_checkpoint(MEMORY_TIER)`` every k optimizer steps, at the point of the loop where
Lightning's ``ModelCheckpoint`` saves its step-interval checkpoints (the end of a training batch):
the checkpoint dict is Lightning's own (loop state, optimizers, schedulers, callbacks, the train
loaders' positions), so ``trainer.fit(model, ckpt_path=MEMORY_TIER)`` resumes exactly as from a
``ModelCheckpoint`` file of that step. The tier keeps the newest generation in node memory,
replicated to peer nodes, and writes every few saves to its persistent path; a resume reads the
newest generation complete across both.

A memory tier is saved and loaded by every rank together (each writes its own part into its node's
memory): beyond one process that takes bcp_lightning's strategies, which call the plugin on every
rank; Lightning's own call it on rank 0 alone.
"""

from __future__ import annotations

from typing import Any

import bcp
from bcp_lightning.io import CheckpointIOMixin
from bcp_lightning.strategies import StrategyMixin
from bcp_lightning.targets import MEMORY_TIER


class MemoryTierCheckpointMixin:
    """Saves the Trainer's checkpoint to the memory tier of its ``BCPCheckpointIO(memory_tier=...)``
    every ``every_n_train_steps`` optimizer steps; resume with
    ``trainer.fit(model, ckpt_path=bcp_lightning.MEMORY_TIER)``. Beyond one process it needs a
    bcp_lightning strategy (``BCPDDPStrategy``, ``BCPFSDPStrategy``, ``BCPModelParallelStrategy``)."""

    def __init__(self, *, every_n_train_steps: int) -> None:
        super().__init__()
        if type(every_n_train_steps) is not int or every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be an integer >= 1, got {every_n_train_steps!r}")
        self.every_n_train_steps = every_n_train_steps
        self._last_saved_step = 0  # as ModelCheckpoint: nothing to save before the first step

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Refuse, on every rank alike, a Trainer that cannot save to a memory tier."""
        strategy = trainer.strategy
        io = strategy.checkpoint_io
        if not isinstance(io, CheckpointIOMixin) or io.memory_tier is None:
            raise bcp.CheckpointError(
                "MemoryTierCheckpoint saves to the memory tier of the checkpoint plugin, and the Trainer's "
                f"{type(io).__name__} has none: pass plugins=[BCPCheckpointIO(memory_tier=bcp.MemoryTier(...))]",
                path=MEMORY_TIER)
        if trainer.world_size > 1 and not isinstance(strategy, StrategyMixin):
            raise bcp.CheckpointError(
                f"a memory tier is saved by every rank, and {type(strategy).__name__} saves on rank 0 alone: use "
                "bcp_lightning's BCPDDPStrategy, BCPFSDPStrategy or BCPModelParallelStrategy", path=MEMORY_TIER)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        # With gradient accumulation several batches end at one optimizer step: save it once.
        if (step % self.every_n_train_steps or step == self._last_saved_step or trainer.sanity_checking
                or trainer.fast_dev_run):
            return
        trainer.save_checkpoint(MEMORY_TIER)
        self._last_saved_step = step
