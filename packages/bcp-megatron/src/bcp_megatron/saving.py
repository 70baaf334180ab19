"""The save both strategy flavours share: a Megatron sharded state dict through ``bcp.save`` (whose
planner proves that the pieces of every tensor, the distributed optimizer's irregular 1-D buckets
included, cover it exactly)."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import bcp
from bcp.integration import as_coordinator

from bcp_megatron.adapter import NAME as ADAPTER_NAME
from bcp_megatron.adapter import MegatronValues
from bcp_megatron.shards import MODEL, OPTIMIZER, save_values

COMPONENTS = (MODEL, OPTIMIZER)
#: Committed generations a checkpoint folder keeps, as ``bcp.save`` (the save strategies' default).
DEFAULT_KEEP_GENERATIONS = bcp.SaveOptions().keep_generations
_ITERATION_FOLDER = re.compile(r"iter_(\d+)")


class BcpSaver:
    """Saves sharded state dicts with ``options``."""

    def __init__(self, options: bcp.SaveOptions) -> None:
        self.options = options

    def save(self, sharded_state_dict: dict, checkpoint_dir: "str | os.PathLike | bcp.MemoryTier", *,
             async_save: bool, extra: dict | None = None) -> bcp.SaveHandle:
        """Save the sharded state dict's tensors and objects, and ``extra`` components of this
        rank's (plain values), to a folder or a memory tier."""
        coord = as_coordinator(self.options.coordinator)
        values = save_values(sharded_state_dict)
        # Both components on every rank, so the manifest names Megatron whichever rank commits.
        state = {component: MegatronValues(values.get(component, {})) for component in COMPONENTS}
        state.update(extra or {})
        # Megatron-Core logs its strategies' routine work at DEBUG (Megatron-LM prints its own line
        # per save): bcp's summary follows, so a Megatron log at INFO gets nothing new from a save.
        return bcp.save(checkpoint_dir, state, self.options, framework=ADAPTER_NAME, async_save=async_save,
                        coordinator=coord, topology=self.options.topology or parallel_topology(),
                        summary_log_level=logging.DEBUG,
                        step=self.options.step if self.options.step is not None else iteration_of(checkpoint_dir))


def iteration_of(checkpoint_dir: Any) -> int | None:
    """The training iteration a Megatron-LM checkpoint folder is named after (``iter_0000100``, its
    ``get_checkpoint_name``): the strategy sees no other (the iteration is in the common state,
    which Megatron writes itself). None for another name, and for a target that is no folder (a
    ``bcp.MemoryTier``)."""
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        return None
    match = _ITERATION_FOLDER.fullmatch(os.path.basename(os.path.normpath(os.fspath(checkpoint_dir))))
    return int(match.group(1)) if match else None


def parallel_topology() -> dict[str, int] | None:
    """This rank's data/tensor/pipeline/expert-parallel coordinates from Megatron's parallel state, for
    the metrics records' heat map; None before ``initialize_model_parallel``."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return {"dp": parallel_state.get_data_parallel_rank(), "tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "ep": parallel_state.get_expert_model_parallel_rank()}
