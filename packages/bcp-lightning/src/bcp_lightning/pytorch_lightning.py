"""bcp_lightning's classes for the standalone ``pytorch_lightning`` package (``import pytorch_lightning``)."""

import lightning_fabric.plugins as _fabric_plugins
import pytorch_lightning.strategies as _strategies

from bcp_lightning.binding import bind as _bind

BCPCheckpointIO, BCPDDPStrategy, BCPFSDPStrategy, BCPModelParallelStrategy = _bind(
    _fabric_plugins.CheckpointIO, _strategies, __name__)

__all__ = ["BCPCheckpointIO", "BCPDDPStrategy", "BCPFSDPStrategy", "BCPModelParallelStrategy"]
