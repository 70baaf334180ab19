"""``bcp_accelerate.Accelerator``: accelerate's Accelerator with checkpoints through bcp."""

from __future__ import annotations

from typing import Any

import accelerate

import bcp
from bcp_accelerate.generations import DEFAULT_KEEP_GENERATIONS
from bcp_accelerate.switch import enable


class Accelerator(accelerate.Accelerator):
    """A drop-in ``accelerate.Accelerator`` whose ``save_state``/``load_state`` go through bcp
    (unless ``ACCELERATE_CHECKPOINT_ENGINE=accelerate`` says otherwise). ``keep_generations``,
    ``memory_tier``, ``incremental``, ``async_save``, ``overlap`` and ``compression`` as for
    ``bcp_accelerate.enable``."""

    def __init__(self, *args: Any, keep_generations: int = DEFAULT_KEEP_GENERATIONS,
                 memory_tier: "bcp.MemoryTier | None" = None, incremental: bool = False, async_save: bool = False,
                 overlap: bool = False, compression: "bcp.Compression | str | bool | None" = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        enable(self, keep_generations=keep_generations, memory_tier=memory_tier, incremental=incremental,
               async_save=async_save, overlap=overlap, compression=compression)
