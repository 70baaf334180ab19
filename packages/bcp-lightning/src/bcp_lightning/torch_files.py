"""Lightning's own single-file checkpoints (``TorchCheckpointIO``), read so that a run can switch
to bcp midway: the first resume reads the ``.ckpt`` file the run already wrote, later saves go
through bcp.

Such a file is a pickle. It is read with ``torch.load(weights_only=True)`` only, whose unpickler
builds tensors, containers and primitive values and refuses every other global, so a hostile file
cannot run code; the ``allow_pickle`` option does not widen this.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

import bcp


def load(path: str) -> dict[str, Any]:
    """The checkpoint dict in the single-file checkpoint at ``path``, tensors on the CPU."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise bcp.UnsafeCheckpointError(
            f"torch.load(weights_only=True) refused this single-file checkpoint ({_reason(exc)}): it holds "
            "objects other than tensors, containers and primitive values, or is not a torch.save file. "
            "bcp_lightning never unpickles arbitrary objects", path=path) from exc
    except (RuntimeError, EOFError, OSError) as exc:
        raise bcp.CorruptCheckpointError(f"not a readable torch.save checkpoint: {_reason(exc)}", path=path) from exc
    if not isinstance(checkpoint, dict):
        raise bcp.CheckpointError(
            f"this torch.save file holds a {type(checkpoint).__name__}, not a Lightning checkpoint dict", path=path)
    return checkpoint


def _reason(exc: BaseException) -> str:
    """torch's own reason for refusing, without its advice to retry with ``weights_only=False``
    (its message's layout varies with the failure)."""
    before, _, after = str(exc).partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (after or before).splitlines()]
    reasons = [line for line in lines if line and not line.startswith(_TORCH_ADVICE)]
    return reasons[0].split(". ")[0].rstrip(".") if reasons else type(exc).__name__


_TORCH_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation", "(1)", "(2)")
