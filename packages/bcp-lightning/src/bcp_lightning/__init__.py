"""bcp for Lightning: checkpoints that resume on any world size and parallel layout.

``Trainer(plugins=[BCPCheckpointIO()])`` routes single-device and DDP checkpointing through bcp;
``Trainer(strategy=BCPDDPStrategy())``, ``BCPFSDPStrategy()`` or ``BCPModelParallelStrategy()``
save and load on every rank with the live, possibly sharded, model and optimizers. These classes
are for the ``lightning`` package; ``bcp_lightning.pytorch_lightning`` has the same for the
standalone ``pytorch_lightning`` package. ``BCPCheckpointIO(memory_tier=tier)`` with
``MemoryTierCheckpoint(every_n_train_steps=k)`` saves into a ``bcp.MemoryTier`` (node memory,
replicated, persisted every few saves) and ``trainer.fit(model, ckpt_path=MEMORY_TIER)`` resumes from
it. Without a Trainer, ``load`` and ``load_from_checkpoint`` read a checkpoint into a module
(``LightningModule.load_from_checkpoint`` reads torch files only).
"""

import lightning.fabric.plugins as _fabric_plugins
import lightning.pytorch.callbacks as _callbacks
import lightning.pytorch.strategies as _strategies

from bcp_lightning.binding import bind as _bind
from bcp_lightning.options import Options
from bcp_lightning.outside import load, load_from_checkpoint
from bcp_lightning.targets import MEMORY_TIER

BCPCheckpointIO, BCPDDPStrategy, BCPFSDPStrategy, BCPModelParallelStrategy, MemoryTierCheckpoint = _bind(
    _fabric_plugins.CheckpointIO, _strategies, _callbacks.Callback, __name__)

__all__ = ["BCPCheckpointIO", "BCPDDPStrategy", "BCPFSDPStrategy", "BCPModelParallelStrategy", "MEMORY_TIER",
           "MemoryTierCheckpoint", "Options", "load", "load_from_checkpoint"]
