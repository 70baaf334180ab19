"""bcp_lightning's classes for the standalone ``pytorch_lightning`` package (``import pytorch_lightning``)."""

import lightning_fabric.plugins as _fabric_plugins
import pytorch_lightning.callbacks as _callbacks
import pytorch_lightning.strategies as _strategies

from bcp_lightning.binding import bind as _bind
from bcp_lightning.targets import MEMORY_TIER

BCPCheckpointIO, BCPDDPStrategy, BCPFSDPStrategy, BCPModelParallelStrategy, MemoryTierCheckpoint = _bind(
    _fabric_plugins.CheckpointIO, _strategies, _callbacks.Callback, __name__)

__all__ = ["BCPCheckpointIO", "BCPDDPStrategy", "BCPFSDPStrategy", "BCPModelParallelStrategy", "MEMORY_TIER",
           "MemoryTierCheckpoint"]
