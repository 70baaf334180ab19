"""How ``save_state`` treats a checkpoint folder (or memory tier) it writes again, per accelerator
(set by ``bcp_accelerate.enable(..., keep_generations=, incremental=)``): how many committed
generations it keeps, and whether a new one writes only what changed."""

from __future__ import annotations

from typing import Any

from bcp import CheckpointError, SaveOptions

#: As ``bcp.save``: the newest committed generation and the one before it (a reader of that one is
#: not broken by the next save).
DEFAULT_KEEP_GENERATIONS = SaveOptions().keep_generations

_ATTRIBUTE = "_bcp_keep_generations"
_INCREMENTAL = "_bcp_incremental"


def set_kept(accelerator: Any, keep_generations: int) -> None:
    if type(keep_generations) is not int or keep_generations < 1:
        raise CheckpointError(f"keep_generations must be an integer >= 1, not {keep_generations!r}")
    setattr(accelerator, _ATTRIBUTE, keep_generations)


def kept(accelerator: Any) -> int:
    return getattr(accelerator, _ATTRIBUTE, DEFAULT_KEEP_GENERATIONS)


def set_incremental(accelerator: Any, incremental: bool) -> None:
    if type(incremental) is not bool:
        raise CheckpointError(f"incremental must be True or False, not {incremental!r}")
    setattr(accelerator, _INCREMENTAL, incremental)


def incremental(accelerator: Any) -> bool:
    return getattr(accelerator, _INCREMENTAL, False)
