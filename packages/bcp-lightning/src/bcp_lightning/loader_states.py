"""The fit loop's dataloader states as bcp's ``dataloader`` component.

Lightning's fit loop puts the ``state_dict()`` of every stateful train dataloader (a torchdata
``StatefulDataLoader``, or any loader with ``state_dict``/``load_state_dict``) into its checkpoint
at ``loops.fit_loop.state_dict.combined_loader``, and gives them back to the loaders when a fit
resumes. bcp_lightning takes that list out of Lightning's other entries and saves it through
``bcp.DataloaderState``, each saving rank as its own DP index, since the loop's state is per rank
(every rank under bcp_lightning's strategies, also under tensor parallelism; rank 0 alone through
the plugin, whose part every rank then reads, as Lightning does). Resuming on the same DP size
gives each rank its own loaders' states; on another, the load fails with a clear error instead of
handing one rank's position to all.
"""

from __future__ import annotations

from typing import Any, Mapping

import bcp
from bcp.integration import DATALOADER_COMPONENT as COMPONENT

_PATH = ("loops", "fit_loop", "state_dict")
_KEY = "combined_loader"


class FitLoopLoaders:
    """The fit loop's list of loader states, as bcp saves and restores it."""

    def __init__(self, states: list[Any] | None = None) -> None:
        self.states = states

    def state_dict(self) -> dict[str, Any]:
        return {"loaders": self.states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.states = state["loaders"]


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
    """Give the loaded loader states back to the fit loop's entry, where Lightning looks for them."""
    if COMPONENT in loaded:
        loop = _loop_state(rest)
        if loop is not None:
            loop[_KEY] = loaded[COMPONENT].loader.states


def _loop_state(rest: Mapping[str, Any]) -> dict[str, Any] | None:
    level: Any = rest
    for key in _PATH:
        level = level.get(key) if isinstance(level, Mapping) else None
    return level if isinstance(level, dict) else None
