"""What the plugin and the strategies save to and load from: a checkpoint path (a local path or a
storage URL: a directory of generations, or Lightning's own single-file checkpoint) or a
``bcp.MemoryTier`` (node memory replicated to peer nodes, with a persistent copy every few saves).

Lightning treats every ``ckpt_path`` as a path (``ModelCheckpoint`` compares it with its own files
through ``pathlib.Path``), so the tier is named by a string, :data:`MEMORY_TIER`, that the plugin
resolves to its ``memory_tier``."""

from __future__ import annotations

import os
from typing import Any, Union

import bcp

#: A checkpoint path as a string, or a memory tier.
Target = Union[str, "bcp.MemoryTier"]

#: The checkpoint path that names the plugin's memory tier: ``Trainer.save_checkpoint(MEMORY_TIER)``,
#: ``trainer.fit(model, ckpt_path=MEMORY_TIER)``.
MEMORY_TIER = "bcp:memory-tier"


def of(path: Any, tier: "bcp.MemoryTier | None") -> Target:
    """The target Lightning handed over: ``tier`` for :data:`MEMORY_TIER`, a memory tier as it is,
    any other path as a string."""
    if is_tier(path):
        return path
    location = os.fspath(path)
    if location != MEMORY_TIER:
        return location
    if tier is None:
        raise bcp.CheckpointError(
            f"{MEMORY_TIER!r} names the memory tier of the checkpoint plugin, and it has none: pass "
            "BCPCheckpointIO(memory_tier=bcp.MemoryTier(...)) to the Trainer or the strategy", path=MEMORY_TIER)
    return tier


def is_tier(target: Any) -> bool:
    return isinstance(target, bcp.MemoryTier)


def name(target: Target) -> str:
    """How messages and the pending-save records name the target."""
    return target.display if is_tier(target) else target
