"""Where the tools write: always a new place, never the source (a tool never modifies its input)."""

from __future__ import annotations

import os
from typing import Sequence

from bcp.errors import CheckpointError
from bcp.storage import LocalStorage, storage_for


def local_dir(path: "str | os.PathLike") -> str:
    """The absolute local directory a path (or ``file://`` URL) names."""
    try:
        storage = storage_for(path)
    except ValueError as exc:
        raise CheckpointError(f"{exc}; the tools read and write local paths") from None
    if not isinstance(storage, LocalStorage):
        raise CheckpointError(f"the tools read and write local paths, got {os.fspath(path)!r}")
    return os.path.realpath(storage.root)


def check_new_output(out: "str | os.PathLike", sources: Sequence["str | os.PathLike"], *,
                     may_exist: bool = False) -> str:
    """The output directory, refused when it overlaps a source or (unless ``may_exist``) is not
    empty, so that no run can clobber data it did not create."""
    target = local_dir(out)
    for source in sources:
        origin = local_dir(source)
        if _inside(target, origin) or _inside(origin, target):
            raise CheckpointError(f"the output {target!r} overlaps the source {origin!r}; write to another folder")
    if os.path.exists(target) and not os.path.isdir(target):
        raise CheckpointError(f"the output {target!r} exists and is not a folder")
    if not may_exist and os.path.isdir(target) and os.listdir(target):
        raise CheckpointError(f"the output folder {target!r} is not empty; choose a new or empty folder")
    return target


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)
