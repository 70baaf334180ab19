"""The environment variable through which an integration's user chooses a checkpoint engine.

Every launcher (``torchrun``, ``accelerate launch``, SLURM) passes the environment on to the
processes, so the no-code-change flag of an integration is a variable; it is read at each call,
never cached at import, so that setting or clearing it takes effect at the next save or load.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from bcp.errors import CheckpointError


def requested_engine(variable: str, engines: Sequence[str]) -> str | None:
    """The engine (one of ``engines``) that the environment variable ``variable`` names, or ``None``
    when it is unset or empty; any other value is a :class:`CheckpointError`."""
    value = os.environ.get(variable, "").strip().lower()
    if not value:
        return None
    if value not in engines:
        raise CheckpointError(f"{variable}={os.environ[variable]!r} names no checkpoint engine: "
                              f"use one of {', '.join(engines)}, or leave it unset")
    return value
