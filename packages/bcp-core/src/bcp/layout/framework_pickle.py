"""Files a framework insists on writing with its own pickle (Megatron's ``common.pt``, accelerate's
schedulers and samplers) sit beside bcp's data in a checkpoint folder. They are read with
``torch.load(weights_only=True)``, which refuses any pickle that would run code; this turns that
refusal into bcp's error naming the checkpoint and the file."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator

from bcp.errors import UnsafeCheckpointError

_REASON_MARK = "WeightsUnpickler error:"


@contextlib.contextmanager
def refusing_pickled_code(checkpoint: str, file: str) -> Iterator[None]:
    """Around a ``weights_only=True`` load of ``file`` in ``checkpoint``: a pickle that would run
    code (or build an object outside torch's allow-list) raises :class:`UnsafeCheckpointError`."""
    try:
        yield
    except pickle.UnpicklingError as exc:
        lines = str(exc).splitlines()
        reason = next((line.split(_REASON_MARK, 1)[1].strip() for line in lines if _REASON_MARK in line),
                      lines[0] if lines else type(exc).__name__)
        raise UnsafeCheckpointError(
            f"refusing to load a pickled object that torch's weights_only loader does not allow ({reason}); "
            "bcp never runs code from a checkpoint", path=checkpoint, key=file) from exc
