"""The public classes, made for one Lightning package.

``lightning`` (``lightning.pytorch``) and the standalone ``pytorch_lightning`` have distinct class
hierarchies, and a Trainer accepts only plugins and strategies of its own package, so the same
mixins are bound to each package's base classes.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

from bcp_lightning.io import CheckpointIOMixin
from bcp_lightning.live_state import FSDP1_SHARDS
from bcp_lightning.memory_tier import MemoryTierCheckpointMixin
from bcp_lightning.strategies import StrategyMixin, device_mesh_topology


class Bound(NamedTuple):
    BCPCheckpointIO: type[CheckpointIOMixin]
    BCPDDPStrategy: type[StrategyMixin]
    BCPFSDPStrategy: type[StrategyMixin]
    BCPModelParallelStrategy: type[StrategyMixin]
    MemoryTierCheckpoint: type[MemoryTierCheckpointMixin]


def bind(checkpoint_io_base: type, strategies: ModuleType, callback_base: type, module: str) -> Bound:
    """The classes for one Lightning package: ``checkpoint_io_base`` is its ``CheckpointIO``,
    ``strategies`` its ``strategies`` module, ``callback_base`` its ``Callback``; ``module`` is where
    the classes are published (so that they pickle, as ``ddp_spawn`` requires)."""
    io = type("BCPCheckpointIO", (CheckpointIOMixin, checkpoint_io_base),
              {"__module__": module, "__doc__": CheckpointIOMixin.__doc__})

    def strategy(name: str, base: type, doc: str, **attributes: object) -> type[StrategyMixin]:
        return type(name, (StrategyMixin, base),
                    {"__module__": module, "__doc__": doc, "checkpoint_io_class": io, **attributes})

    return Bound(
        io,
        strategy("BCPDDPStrategy", strategies.DDPStrategy,
                 "Lightning's DDPStrategy, saving on every rank through bcp (replicated state written once).",
                 loads_index_keyed_optimizer_states=True),
        strategy("BCPFSDPStrategy", strategies.FSDPStrategy,
                 "Lightning's FSDPStrategy (FSDP1), saving each rank's flat-parameter shards through bcp, with "
                 "no all-gather; ``state_dict_type`` has no effect.", live_state=FSDP1_SHARDS),
        strategy("BCPModelParallelStrategy", strategies.ModelParallelStrategy,
                 "Lightning's ModelParallelStrategy (FSDP2 and tensor parallelism), saving sharded checkpoints "
                 "through bcp on every rank; ``save_distributed_checkpoint`` has no effect.",
                 checkpoint_topology=device_mesh_topology),
        type("MemoryTierCheckpoint", (MemoryTierCheckpointMixin, callback_base),
             {"__module__": module, "__doc__": MemoryTierCheckpointMixin.__doc__}),
    )
