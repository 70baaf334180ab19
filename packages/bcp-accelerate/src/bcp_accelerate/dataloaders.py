"""The accelerator's stateful dataloaders (``DataLoaderConfiguration(use_stateful_dataloader=True)``)
as bcp's ``dataloader`` component: each process's loaders' ``state_dict()`` saved as its DP index's
part through ``bcp.DataloaderState`` (accelerate would ``torch.save`` them from every process into
one shared file name), restored on the same number of processes and resharded on another.

Accelerate's own files still hold the rest of each loader (a seedable sampler): the loaders are
handed to it as :class:`SamplerOnly`, which tells it their state is not its to save or load.
"""

from __future__ import annotations

from typing import Any, Sequence

import bcp
from bcp import MismatchError
from bcp.integration import reshard_states
from bcp.integration import DATALOADER_COMPONENT


def is_stateful(loader: Any) -> bool:
    return bool(getattr(loader, "use_stateful_dataloader", False))


class StatefulLoaders:
    """The stateful loaders among the prepared ones, as one :class:`bcp.ShardedDataloader`: each
    process's loaders' states (by the loader's position among every prepared dataloader) are its DP
    index's part; on another number of processes each loader's state is resharded from all the saved
    processes' (:func:`bcp.integration.reshard_states`: accelerate deals the batches
    of one global order round-robin to the processes)."""

    def __init__(self, loaders: Sequence[Any], *, process: int = 0, processes: int = 1) -> None:
        self.loaders = {str(i): loader for i, loader in enumerate(loaders) if is_stateful(loader)}
        self.process, self.processes = process, processes

    def replicated_state(self) -> None:
        return None

    def sharded_states(self) -> list[dict[str, Any]]:
        return [{index: loader.state_dict() for index, loader in self.loaders.items()}]

    @staticmethod
    def assign_parts(saved: list[bcp.PartKey], dp_size: int) -> list[list[bcp.PartKey]]:
        """Every process reads every saved process's states: a change of their number needs them all."""
        return [list(saved) for _ in range(dp_size)]

    def load_dataloader_state(self, replicated: Any, sharded: list[dict[str, Any]]) -> None:
        if sorted(sharded[0]) != sorted(self.loaders):
            raise MismatchError(f"stateful dataloaders at positions {sorted(sharded[0])} were saved, the accelerator "
                                f"has them at {sorted(self.loaders)}", key=DATALOADER_COMPONENT)
        states = {index: reshard_states([saved[index] for saved in sharded], self.process, self.processes)
                  for index in self.loaders}
        for index, loader in self.loaders.items():
            loader.load_state_dict(states[index])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The states of a checkpoint that saved them as one ``state_dict`` per process."""
        self.load_dataloader_state(None, [state] * self.processes)


def component(accelerator: Any) -> dict[str, bcp.DataloaderState]:
    """``{"dataloader": ...}`` when the accelerator has stateful dataloaders, else nothing. Every
    process is a DP rank (accelerate's data parallelism) and writes its own part."""
    loaders = StatefulLoaders(accelerator._dataloaders, process=accelerator.process_index,
                              processes=accelerator.num_processes)
    if not loaders.loaders:
        return {}
    return {DATALOADER_COMPONENT: bcp.DataloaderState(loaders, dp_rank=accelerator.process_index,
                                                      dp_size=accelerator.num_processes)}


class SamplerOnly:
    """A stateful dataloader as accelerate's own files see it when bcp holds its state."""

    use_stateful_dataloader = False

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def for_accelerate_files(loaders: Sequence[Any], in_bcp: bool) -> list[Any]:
    """The loaders to hand accelerate's own save/load: stateful ones as :class:`SamplerOnly` when
    bcp holds their state."""
    return [SamplerOnly(loader) if in_bcp and is_stateful(loader) else loader for loader in loaders]
