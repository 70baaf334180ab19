"""Accelerate's own files in a checkpoint folder, read without running code.

Accelerate loads its schedulers, samplers, scaler and RNG states with ``torch.load(weights_only=True)``
(plus its allow-list of numpy types), but the objects registered with ``register_for_checkpointing``
with ``weights_only=False``: a hostile ``custom_checkpoint_<i>.pkl`` would run code. bcp stores
those objects in its own checkpoint instead (see the engine); the ``.pkl`` files of folders written
by accelerate's own engine are read here with ``weights_only=True``. Either way a pickle torch
refuses becomes ``bcp.UnsafeCheckpointError`` naming the folder and the file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import accelerate.accelerator
from accelerate.utils import load as accelerate_load

from bcp.integration import refusing_pickled_code


def custom_file(index: int) -> str:
    """Accelerate's name for the ``index``-th registered object's file."""
    return f"custom_checkpoint_{index}.pkl"


def load_custom_state(obj: Any, path: str, index: int = 0) -> None:
    """``accelerate.checkpointing.load_custom_state`` with ``weights_only=True``."""
    with refusing_pickled_code(path, custom_file(index)):
        state = accelerate_load(os.path.join(path, custom_file(index)), map_location="cpu", weights_only=True)
    obj.load_state_dict(state)


@contextlib.contextmanager
def safe_accelerate_load(folder: str) -> Iterator[None]:
    """While accelerate's own ``load_state`` reads ``folder``: registered objects load through
    :func:`load_custom_state`, and any file torch refuses is a ``bcp.UnsafeCheckpointError``."""
    original = accelerate.accelerator.load_custom_state
    accelerate.accelerator.load_custom_state = load_custom_state
    try:
        with refusing_pickled_code(folder, "accelerate's files"):
            yield
    finally:
        accelerate.accelerator.load_custom_state = original
