"""The save both strategy flavours share: a Megatron sharded state dict through ``bcp.save``, after
the exact coverage check of its 1-D tensors."""

from __future__ import annotations

import os

import bcp
from bcp.integration import Coordinator, Outcome, default_coordinator

from bcp_megatron.adapter import NAME as ADAPTER_NAME
from bcp_megatron.adapter import MegatronValues
from bcp_megatron.coverage import OneDimCoverage
from bcp_megatron.shards import MODEL, OPTIMIZER, save_values

DEFAULT_IO_THREADS = 4
COMPONENTS = (MODEL, OPTIMIZER)


class BcpSaver:
    """Saves sharded state dicts; remembers which 1-D structure it already proved covered."""

    def __init__(self, *, allow_pickle: bool, io_threads: int, coordinator: Coordinator | None) -> None:
        self.allow_pickle = allow_pickle
        self.io_threads = io_threads
        self.coordinator = coordinator
        self._coverage = OneDimCoverage()

    def save(self, sharded_state_dict: dict, checkpoint_dir: "str | os.PathLike", *,
             async_save: bool) -> bcp.SaveHandle:
        coord = self.coordinator or default_coordinator()
        values = Outcome.of(lambda: save_values(sharded_state_dict))
        self._coverage.check(coord, Outcome(values.value.spans if values.error is None else None, values.error))
        # Both components on every rank, so the manifest names Megatron whichever rank commits.
        state = {component: MegatronValues(values.value.components.get(component, {})) for component in COMPONENTS}
        return bcp.save(checkpoint_dir, state, framework=ADAPTER_NAME, async_save=async_save, coordinator=coord,
                        allow_pickle=self.allow_pickle, io_threads=self.io_threads)
