"""bcp for Megatron-Core: ``dist_checkpointing`` save and load strategies backed by bcp.

With Megatron-Core <= 0.16, importing the package registers the ``('bcp', 1)`` backend::

    import bcp_megatron
    dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=("bcp", 1))
    dist_checkpointing.load(sharded_state_dict, ckpt_dir)   # picks bcp from metadata.json

Megatron-Core 0.17+ has no registry: pass ``bcp_megatron.BcpSaveShardedStrategy()`` and
``bcp_megatron.BcpLoadShardedStrategy()`` explicitly (the same names, built on torch_dist's classes).
Megatron-LM training scripts accept ``--ckpt-format bcp`` through ``python -m bcp_megatron.launch``.
``bcp_megatron.save_to_tier``/``load_from_tier`` save and load a sharded state dict in a
``bcp.MemoryTier`` (node memory, replicated to peer nodes, persisted every few saves): the
counterpart of Megatron-LM's non-persistent local checkpoints.
"""

from megatron.core.dist_checkpointing.strategies import base as _megatron_strategies

from bcp_megatron.version import BACKEND, VERSION, __version__

if hasattr(_megatron_strategies, "register_default_strategy"):  # Megatron-Core <= 0.16
    from bcp_megatron.strategies import BcpLoadShardedStrategy, BcpSaveShardedStrategy, register
else:
    from bcp_megatron.strategies_torch_dist import BcpLoadShardedStrategy, BcpSaveShardedStrategy, register

from bcp_megatron.memory_tier import load_from_tier, save_to_tier

register()

__all__ = ["BACKEND", "VERSION", "BcpSaveShardedStrategy", "BcpLoadShardedStrategy", "load_from_tier", "register",
           "save_to_tier", "__version__"]
