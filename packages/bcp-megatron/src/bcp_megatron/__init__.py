"""bcp for Megatron-Core: ``dist_checkpointing`` save and load strategies backed by bcp.

With Megatron-Core <= 0.16, importing the package registers the ``('bcp', 1)`` backend::

    import bcp_megatron
    dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=("bcp", 1))
    dist_checkpointing.load(sharded_state_dict, ckpt_dir)   # picks bcp from metadata.json

Megatron-Core 0.17+ has no registry: pass ``bcp_megatron.BcpSaveShardedStrategy()`` and
``bcp_megatron.BcpLoadShardedStrategy()`` explicitly (the same names, built on torch_dist's classes).
Megatron-LM training scripts accept ``--ckpt-format bcp`` through ``python -m bcp_megatron.launch``.
"""

from megatron.core.dist_checkpointing.strategies import base as _megatron_strategies

from bcp_megatron.version import BACKEND, VERSION, __version__

if hasattr(_megatron_strategies, "register_default_strategy"):  # Megatron-Core <= 0.16
    from bcp_megatron.strategies import BcpLoadShardedStrategy, BcpSaveShardedStrategy, register
else:
    from bcp_megatron.strategies_torch_dist import BcpLoadShardedStrategy, BcpSaveShardedStrategy, register

register()

__all__ = ["BACKEND", "VERSION", "BcpSaveShardedStrategy", "BcpLoadShardedStrategy", "register", "__version__"]
