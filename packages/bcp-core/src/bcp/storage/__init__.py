"""Storage backends: bytes in and out, knowing nothing of tensors."""

from __future__ import annotations

import os

from bcp.storage.base import Storage
from bcp.storage.local import LocalStorage

__all__ = ["Storage", "LocalStorage", "storage_for"]


def storage_for(path: "str | os.PathLike | Storage") -> Storage:
    """The backend for a checkpoint path. A ``Storage`` instance is used as is; a plain path or a
    ``file://`` URL is a local directory. Other schemes are refused until their backend exists."""
    if isinstance(path, Storage):
        return path
    text = os.fspath(path)
    if "://" in text:
        scheme, rest = text.split("://", 1)
        if scheme == "file":
            return LocalStorage(rest)
        raise ValueError(f"no storage backend for scheme {scheme!r} in {text!r}")
    return LocalStorage(text)
