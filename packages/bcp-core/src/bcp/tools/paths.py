"""Where the tools write: always a new place, never the source (no command modifies its input; only
``bcp.remove_entries``, called from Python, rewrites a checkpoint in place).

A bcp checkpoint the tools write (``edit``, ``convert --from``) may go to any storage URL, as its
source may come from one. Files in other formats (safetensors exports, DCP folders) are written with
local file functions, so those outputs must be local folders.
"""

from __future__ import annotations

import os
from typing import Sequence

from bcp.errors import CheckpointError
from bcp.storage import LocalStorage, Storage, is_url, storage_for


def _storage(path: "str | os.PathLike") -> Storage:
    try:
        return storage_for(path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _place(path: "str | os.PathLike", storage: Storage) -> str:
    """What a path or URL names, comparable with another's: a real local path, or the URL itself."""
    if isinstance(storage, LocalStorage):
        return os.path.realpath(storage.root)
    return os.fspath(path).rstrip("/")


def check_new_output(out: "str | os.PathLike", sources: Sequence["str | os.PathLike"], *,
                     may_exist: bool = False) -> str:
    """The output (a real local path, or the URL as given), refused when it overlaps a source or
    (unless ``may_exist``) is not empty, so that no run can clobber data it did not create."""
    storage = _storage(out)
    target = _place(out, storage)
    for source in sources:
        origin = _place(source, _storage(source))
        if _inside(target, origin) or _inside(origin, target):
            raise CheckpointError(f"the output {target!r} overlaps the source {origin!r}; write to another folder")
    if isinstance(storage, LocalStorage) and os.path.exists(target) and not os.path.isdir(target):
        raise CheckpointError(f"the output {target!r} exists and is not a folder")
    if not may_exist and storage.list_dir(""):
        raise CheckpointError(f"the output folder {target!r} is not empty; choose a new or empty folder")
    return target


def check_new_local_output(out: "str | os.PathLike", sources: Sequence["str | os.PathLike"], *,
                           what: str, may_exist: bool = False) -> str:
    """As :func:`check_new_output`, for outputs written as local files (``what`` says which)."""
    if not isinstance(_storage(out), LocalStorage):
        raise CheckpointError(f"{what} are written to a local folder, got {os.fspath(out)!r}; "
                              "write them locally, then copy the folder to its storage")
    return check_new_output(out, sources, may_exist=may_exist)


def _inside(path: str, folder: str) -> bool:
    separator = "/" if is_url(folder) else os.sep
    return path == folder or path.startswith(folder.rstrip(separator) + separator)
