"""Megatron's ``common.pt`` in a bcp checkpoint: read with ``torch.load(weights_only=True)``.

Megatron-Core writes the state dict's non-sharded part itself, with ``torch.save``, whatever the
sharded backend (``dist_checkpointing.save`` refuses any common strategy but its own), and records
the ``torch`` common backend in ``metadata.json``. bcp therefore cannot store it in its own
encoding; what it can do is read it without running code. Megatron-Core <= 0.16 picks the common
load strategy from its registry: :class:`SafeCommonLoadStrategy` takes the ``('torch', 1)`` entry
and loads a bcp checkpoint's ``common.pt`` with ``weights_only=True`` (Megatron-Core registers the
classes its common state holds, such as ``argparse.Namespace``, as torch safe globals), so a pickle
that would run code is refused with ``bcp.UnsafeCheckpointError``. Other checkpoints load as before.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy

from bcp.integration import checkpoint_location, refusing_pickled_code

from bcp_megatron.errors import as_megatron_errors


def is_bcp_checkpoint(checkpoint_dir: "str | os.PathLike") -> bool:
    """Whether ``checkpoint_dir`` holds bcp generations (whatever ``metadata.json`` says)."""
    return bool(checkpoint_location(checkpoint_dir, None).generations())


class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
    """Megatron's ``torch`` common load strategy, reading bcp checkpoints' ``common.pt`` with
    ``weights_only=True``."""

    @as_megatron_errors()
    def load_common(self, checkpoint_dir: "str | os.PathLike") -> dict:
        path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
        if not (is_bcp_checkpoint(checkpoint_dir) and os.path.isfile(path)):
            return super().load_common(Path(checkpoint_dir))
        with refusing_pickled_code(os.fspath(checkpoint_dir), COMMON_STATE_FNAME):
            return torch.load(path, map_location="cpu", weights_only=True)
