"""Megatron-Core state in bcp's memory tier: bcp-megatron's counterpart of Megatron-LM's
non-persistent local checkpoints (``--non-persistent-ckpt-type local``).

``dist_checkpointing.save``/``load`` need a folder: Megatron writes ``common.pt`` and
``metadata.json`` there itself, and on a node-local folder those would be lost with the node. So
:func:`save_to_tier` and :func:`load_from_tier` take the places of those two calls for a
``bcp.MemoryTier``, with Megatron's own pre- and post-processing (factories, non-persistent
objects, the integrity check, the merges), and keep everything in the tier's checkpoint: the
ShardedTensors and ShardedObjects through bcp's strategy code, and the common state (Megatron's
``common.pt``: the values that are not sharded) as rank 0's value of the ``megatron_common``
component, which every rank loads, as every rank reads ``common.pt``. It is replicated to peer
nodes and persisted with the rest; bcp's resharding applies, so a job restarted with fewer nodes
loads the survivors' copies into its new layout.
"""

from __future__ import annotations

from typing import Any

from megatron.core.dist_checkpointing.dict_utils import merge
from megatron.core.dist_checkpointing.mapping import apply_factory_merges
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.utils import extract_sharded_base
from megatron.core.dist_checkpointing.validation import (
    StrictHandling,
    determine_global_metadata,
    validate_integrity_and_strict_load,
)

import bcp
from bcp.integration import DEFAULT_IO_THREADS, Coordinator, as_coordinator

from bcp_megatron.completion import completion_request
from bcp_megatron.errors import as_megatron_errors
from bcp_megatron.load import BcpLoader
from bcp_megatron.saving import BcpSaver

#: The bcp component holding Megatron's common state (rank 0's, as ``common.pt``).
COMMON = "megatron_common"


@as_megatron_errors()
def save_to_tier(sharded_state_dict: dict, tier: "bcp.MemoryTier", *, async_save: bool = False,
                 allow_pickle: bool = False, io_threads: int = DEFAULT_IO_THREADS,
                 coordinator: Coordinator | None = None, validate_access_integrity: bool = True,
                 step: int | None = None, incremental: bool = False,
                 compression: "bcp.Compression | str | bool | None" = None) -> AsyncRequest | None:
    """``dist_checkpointing.save(sharded_state_dict, ...)`` into ``tier``; every rank calls it.
    With ``async_save`` returns Megatron's ``AsyncRequest`` once this rank's tensors are staged in
    host memory (schedule it as Megatron-LM does; its finalize step raises the save's error).
    ``allow_pickle``: common values outside bcp's safe encoding (Megatron-LM's ``args`` namespace)
    are pickled, and loading them needs it too. ``step``, recorded with the generation, defaults
    to the state's ``iteration`` (where Megatron-LM keeps its training iteration). ``incremental``:
    only the tensors that changed since the tier's previous generation are written
    (``docs/incremental.md``). ``compression``: as for ``BcpSaveShardedStrategy``."""
    _check_tier(tier)
    sharded_part, common = save_preprocess(sharded_state_dict, validate_access_integrity)
    if step is None:
        step = _iteration(common)
    options = bcp.SaveOptions(allow_pickle=allow_pickle, io_threads=io_threads, coordinator=coordinator, step=step,
                              incremental=incremental, compression=compression)
    extra = {COMMON: common} if as_coordinator(coordinator).rank == 0 else {}
    handle = BcpSaver(options).save(sharded_part, tier, async_save=async_save, extra=extra)
    return completion_request(handle) if async_save else None


def _iteration(common: dict) -> int | None:
    """The common state's ``iteration`` where it is a training step (a non-negative int)."""
    iteration = common.get("iteration")
    if isinstance(iteration, int) and not isinstance(iteration, bool) and iteration >= 0:
        return iteration
    return None


@as_megatron_errors()
def load_from_tier(sharded_state_dict: dict, tier: "bcp.MemoryTier", *, allow_pickle: bool = False,
                   verify: bool = True, io_threads: int = DEFAULT_IO_THREADS, coordinator: Coordinator | None = None,
                   read_once: bool = False, validate_access_integrity: bool = True) -> dict:
    """``dist_checkpointing.load(sharded_state_dict, ...)`` from ``tier``: the newest generation
    complete in node memory (a replaced node's ranks fetch from peers; fewer ranks read the
    survivors'), else the persistent copy; resharded into the requested layout. Returns the
    loaded state dict (common state merged in), as ``dist_checkpointing.load`` does, under
    Megatron's default ``StrictHandling.ASSUME_OK_UNEXPECTED``."""
    _check_tier(tier)
    sharded_state_dict, nonpersistent, factories = load_preprocess(sharded_state_dict)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)
    local_metadata, global_metadata = (determine_global_metadata(sharded_state_dict) if validate_access_integrity
                                       else (None, None))
    sharded_state_dict, _, _ = validate_integrity_and_strict_load(
        sharded_state_dict, StrictHandling.ASSUME_OK_UNEXPECTED, validate_access_integrity, local_metadata,
        global_metadata, None)
    loader = BcpLoader(bcp.LoadOptions(allow_pickle=allow_pickle, verify=verify, io_threads=io_threads,
                                       coordinator=coordinator, read_once=read_once, cast_dtype=True))
    loaded, plain, _ = loader.load_with_values(sharded_state_dict, tier, (COMMON,))
    state_dict: dict[str, Any] = plain[COMMON]
    merge(state_dict, nonpersistent)
    merge(state_dict, loaded)
    return apply_factory_merges(state_dict, factories)


def _check_tier(tier: Any) -> None:
    if not isinstance(tier, bcp.MemoryTier):
        raise TypeError(f"a bcp.MemoryTier is needed, got {type(tier).__name__}; for a folder use "
                        "dist_checkpointing.save/load with bcp's strategies")
