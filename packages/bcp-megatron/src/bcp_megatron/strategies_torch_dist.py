"""The Megatron-facing part for Megatron-Core 0.17 and later, which has no strategy registry and
whose ``dist_checkpointing.save`` replaces any strategy that is not a ``TorchDistSaveShardedStrategy``
(or its fully parallel wrapper) with torch_dist. bcp's strategies here subclass the torch_dist ones
and are passed explicitly::

    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=BcpSaveShardedStrategy())
    dist_checkpointing.load(sd, ckpt_dir, sharded_strategy=BcpLoadShardedStrategy())

0.17's ``load`` does not look at ``metadata.json``, so bcp's load strategy tells the formats apart
itself: a checkpoint with committed bcp generations loads through bcp, any other through torch_dist.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from megatron.core.dist_checkpointing.strategies import fully_parallel
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

import bcp
from bcp.integration import DEFAULT_IO_THREADS, Coordinator

from bcp_megatron.adapter import MegatronAdapter
from bcp_megatron.common_state import is_bcp_checkpoint
from bcp_megatron.completion import completion_request
from bcp_megatron.errors import as_megatron_errors
from bcp_megatron.load import BcpLoader, read_manifest, sharded_metadata, tensors_metadata
from bcp_megatron.removal import remove_sharded
from bcp_megatron.saving import DEFAULT_KEEP_GENERATIONS, BcpSaver
from bcp_megatron.version import BACKEND, VERSION

# Megatron-Core 0.17 added torch_dist's cache_metadata option; 0.16's strategy takes no arguments.
_CACHE_OPTION = "cache_metadata" in inspect.signature(TorchDistLoadShardedStrategy.__init__).parameters


class BcpSaveShardedStrategy(TorchDistSaveShardedStrategy):
    """bcp's save strategy in torch_dist's clothes (see the module docstring); options as for
    Megatron-Core 0.16's ``bcp_megatron.strategies.BcpSaveShardedStrategy``. Wrap it in this module's
    :class:`FullyParallelSaveStrategyWrapper`, or pass ``backend="bcp"`` to Megatron's, so that
    ``metadata.json`` names bcp."""

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, allow_pickle: bool = False,
                 io_threads: int = DEFAULT_IO_THREADS, coordinator: Coordinator | None = None,
                 keep_generations: int = DEFAULT_KEEP_GENERATIONS, incremental: bool = False,
                 compression: "bcp.Compression | str | bool | None" = None) -> None:
        super().__init__(backend, version)
        self.saver = BcpSaver(bcp.SaveOptions(allow_pickle=allow_pickle, io_threads=io_threads,
                                              coordinator=coordinator, keep_generations=keep_generations,
                                              incremental=incremental, compression=compression))

    def can_handle_sharded_objects(self) -> bool:
        return True

    @as_megatron_errors()
    def save(self, sharded_state_dict: dict, checkpoint_dir: "str | os.PathLike") -> None:
        self.saver.save(sharded_state_dict, checkpoint_dir, async_save=False)

    @as_megatron_errors()
    def async_save(self, sharded_state_dict: dict, checkpoint_dir: "str | os.PathLike",
                   async_strategy: str = "mcore") -> Any:
        return completion_request(self.saver.save(sharded_state_dict, checkpoint_dir, async_save=True))


class BcpLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Loads bcp checkpoints into any layout, and torch_dist checkpoints through torch_dist;
    ``cast_dtype`` (on, as torch_dist casts) converts a tensor saved in another dtype than the
    requested one; ``read_once`` reads bytes that several ranks need (data-parallel replicas) once
    and sends them to the others. ``cache_metadata`` is handed to torch_dist's strategy where it has the option
    (Megatron-Core 0.17 and later)."""

    def __init__(self, *, allow_pickle: bool = False, verify: bool = True, io_threads: int = DEFAULT_IO_THREADS,
                 coordinator: Coordinator | None = None, cast_dtype: bool = True, read_once: bool = False,
                 cache_metadata: bool = False) -> None:
        super().__init__(**({"cache_metadata": cache_metadata} if _CACHE_OPTION else {}))
        self.loader = BcpLoader(bcp.LoadOptions(allow_pickle=allow_pickle, verify=verify, io_threads=io_threads,
                                                coordinator=coordinator, cast_dtype=cast_dtype, read_once=read_once))

    def can_handle_sharded_objects(self) -> bool:
        return True

    @as_megatron_errors()
    def load(self, sharded_state_dict: dict, checkpoint_dir: "str | os.PathLike", async_strategy: str = "mcore") -> Any:
        if not is_bcp_checkpoint(checkpoint_dir):
            return super().load(sharded_state_dict, checkpoint_dir, async_strategy)
        return self.loader.load(sharded_state_dict, checkpoint_dir)

    @as_megatron_errors()
    def load_tensors_metadata(self, checkpoint_dir: "str | os.PathLike", metadata: Any = None) -> dict:
        if not is_bcp_checkpoint(checkpoint_dir):
            return super().load_tensors_metadata(checkpoint_dir, metadata)
        return tensors_metadata(read_manifest(checkpoint_dir))

    @as_megatron_errors()
    def load_sharded_metadata(self, checkpoint_dir: "str | os.PathLike") -> dict:
        if not is_bcp_checkpoint(checkpoint_dir):
            return super().load_sharded_metadata(checkpoint_dir)
        return sharded_metadata(read_manifest(checkpoint_dir))

    @as_megatron_errors()
    def remove_sharded_tensors(self, checkpoint_dir: "str | os.PathLike", key_prefix: str) -> None:
        if not is_bcp_checkpoint(checkpoint_dir):
            return super().remove_sharded_tensors(checkpoint_dir, key_prefix)
        remove_sharded(checkpoint_dir, key_prefix)


class FullyParallelSaveStrategyWrapper(fully_parallel.FullyParallelSaveStrategyWrapper):
    """Megatron's wrapper, naming the wrapped strategy's backend in ``metadata.json`` (0.17's own
    names torch_dist unless told otherwise). bcp balances replicated writes itself; the wrapper only
    redistributes main replicas, which bcp's save does not rely on."""

    def __init__(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("backend", strategy.backend)
        kwargs.setdefault("version", strategy.version)
        super().__init__(strategy, *args, **kwargs)


def register() -> None:
    """Megatron-Core 0.17 has no strategy registry: only bcp's framework adapter is registered."""
    bcp.register_adapter(MegatronAdapter(), priority=100)
