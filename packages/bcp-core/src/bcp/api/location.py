"""Resolving a user's ``path`` and ``role`` to a checkpoint location."""

from __future__ import annotations

import os
import re

from bcp.engine.location import Location
from bcp.errors import CheckpointError
from bcp.storage import Storage, storage_for

_ROLE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def resolve(path: "str | os.PathLike | Storage", role: str | None) -> Location:
    storage = storage_for(path)
    display = storage.root if isinstance(path, Storage) else os.fspath(path)
    if role is None:
        return Location(storage, "", display)
    if not isinstance(role, str) or not _ROLE.match(role) or role.startswith("gen-"):
        raise CheckpointError(f"invalid role {role!r}: use letters, digits, '_', '-' and '.'", path=display)
    return Location(storage, f"{role}/", f"{display}/{role}")
