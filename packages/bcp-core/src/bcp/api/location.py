"""Resolving a user's ``path`` and ``role`` to a checkpoint location."""

from __future__ import annotations

import os
import re

from bcp.engine.location import DEFAULT_KEEP_GENERATIONS, METRICS_DIR, Location
from bcp.errors import CheckpointError
from bcp.storage import Storage, storage_for

_ROLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def resolve(path: "str | os.PathLike | Storage", role: str | None,
            keep_generations: int = DEFAULT_KEEP_GENERATIONS) -> Location:
    """The location of ``path`` (a directory, a ``file://`` URL or a storage) and ``role`` (a
    sub-tree name); ``keep_generations`` committed generations survive each save."""
    if not isinstance(path, Storage) and not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"a checkpoint path must be a string, a path or a Storage, not {type(path).__name__}")
    display = path.root if isinstance(path, Storage) else os.fspath(path)
    if not isinstance(display, str) or not display.strip():
        raise CheckpointError(f"empty checkpoint path {display!r}: name a folder (use '.' for the current one)")
    if type(keep_generations) is not int or keep_generations < 1:
        raise CheckpointError(f"keep_generations must be an integer >= 1, not {keep_generations!r}", path=display)
    storage = storage_for(path)
    if role is None:
        return Location(storage, "", display, keep_generations)
    if not isinstance(role, str) or not _ROLE.fullmatch(role) or role.startswith("gen-") or role == METRICS_DIR:
        raise CheckpointError(f"invalid role {role!r}: use letters, digits, '_', '-' and '.' (not gen-*, "
                              f"not {METRICS_DIR})", path=display)
    return Location(storage, f"{role}/", f"{display}/{role}", keep_generations)
