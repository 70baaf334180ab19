"""The fit loop's dataloader states as bcp's ``dataloader`` component.

Lightning's fit loop puts the ``state_dict()`` of every stateful train dataloader (a torchdata
``StatefulDataLoader``, or any loader with ``state_dict``/``load_state_dict``) into its checkpoint
at ``loops.fit_loop.state_dict.combined_loader``, and gives them back to the loaders when a fit
resumes. bcp_lightning takes that list out of Lightning's other entries and saves it through
``bcp.DataloaderState``, each saving rank as its own DP index, since the loop's state is per rank
(every rank under bcp_lightning's strategies, also under tensor parallelism; rank 0 alone through
the plugin, whose part every rank then reads, as Lightning does). Resuming on the same DP size
gives each rank its own loaders' states; on another, each loader's state is resharded where its
ranks walk shards of one global order (torch's ``DistributedSampler``, which Lightning puts in under
DDP, or bcp's sampler) and the consumed batches divide among the new ranks, and refused otherwise.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

import bcp
from bcp.integration import batches_yielded, reshard_states
from bcp.integration import DATALOADER_COMPONENT as COMPONENT

_PATH = ("loops", "fit_loop", "state_dict")
_KEY = "combined_loader"
_BATCH_PROGRESS = "epoch_loop.batch_progress"


class FitLoopLoaders:
    """The fit loop's list of loader states (one per train dataloader), as bcp saves and restores it.

    ``rank`` and ``world`` are the training process's place among the DP ranks whose loaders the
    saved states stand for: every rank saves its own under bcp_lightning's strategies; through the
    plugin rank 0's states stand for all ``world`` ranks (Lightning's own assumption: DDP ranks step
    in lockstep). On another number of ranks each loader's state is resharded from all the saved
    ranks' (:func:`bcp.integration.reshard_states`)."""

    def __init__(self, states: list[Any] | None = None) -> None:
        self.states = states
        self.rank, self.world = _ranks()
        #: How many more batches of the epoch this rank has after a reshard than the saved ranks had.
        self.batches_moved = 0

    def replicated_state(self) -> None:
        return None

    def sharded_states(self) -> list[dict[str, Any]]:
        return [{"loaders": self.states, "world": self.world}]

    @staticmethod
    def assign_parts(saved: list[bcp.PartKey], dp_size: int) -> list[list[bcp.PartKey]]:
        """Every rank reads every saved rank's states: a DP change needs them all (they are small)."""
        return [list(saved) for _ in range(dp_size)]

    def load_dataloader_state(self, replicated: Any, sharded: list[Any]) -> None:
        per_rank = [part["loaders"] for part in sharded]  # in DP order
        if len(per_rank) == 1:
            per_rank = per_rank * int(sharded[0].get("world", 1))
        if len(per_rank) == self.world:
            self.states = per_rank[self.rank]
            return
        self.states = [reshard_states([states[i] for states in per_rank], self.rank, self.world)
                       for i in range(len(per_rank[0]))]
        if self.states:
            self.batches_moved = batches_yielded(self.states[0]) - batches_yielded(per_rank[0][0])


    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The states from a checkpoint that saved them as one ``state_dict`` per rank."""
        self.states = state["loaders"]


def _ranks() -> tuple[int, int]:
    """This process's rank and the number of training processes (Lightning's DDP ranks)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def take_out(rest: Mapping[str, Any], coordinator: bcp.Coordinator) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's other entries without the loader states (copied along the path, the caller's dict
    is left as it is), and the components to save: a ``dataloader`` entry where there are states."""
    loop = _loop_state(rest)
    if loop is None or not loop.get(_KEY):
        return dict(rest), {}
    states = loop[_KEY]
    outer = dict(rest)
    level = outer
    for key in _PATH:
        level[key] = dict(level[key])
        level = level[key]
    del level[_KEY]
    return outer, {COMPONENT: bcp.DataloaderState(FitLoopLoaders(states), dp_rank=coordinator.rank,
                                                   dp_size=coordinator.world_size)}


def template(saved: bool, coordinator: bcp.Coordinator) -> dict[str, Any]:
    """The component to load into, where the checkpoint's layout says loader states were saved."""
    if not saved:
        return {}
    return {COMPONENT: bcp.DataloaderState(FitLoopLoaders(), dp_rank=coordinator.rank,
                                           dp_size=coordinator.world_size)}


def put_back(rest: dict[str, Any], loaded: Mapping[str, Any]) -> None:
    """Give the loaded loader states back to the fit loop's entry, where Lightning looks for them.
    Resharded, the loop's count of batches done in the epoch moves with the loaders' (it ends the
    epoch when that count reaches the new ranks' number of batches)."""
    if COMPONENT not in loaded:
        return
    loaders = loaded[COMPONENT].loader
    loop = _loop_state(rest)
    if loop is not None:
        loop[_KEY] = loaders.states
    progress = rest.get("loops", {}).get("fit_loop", {}).get(_BATCH_PROGRESS)
    if loaders.batches_moved and progress:
        progress["current"] = {name: count + loaders.batches_moved for name, count in progress["current"].items()}


def _loop_state(rest: Mapping[str, Any]) -> dict[str, Any] | None:
    level: Any = rest
    for key in _PATH:
        level = level.get(key) if isinstance(level, Mapping) else None
    return level if isinstance(level, dict) else None
