"""Checkpoint folders: accelerate's automatic naming (``<project_dir>/checkpoints/checkpoint_<n>``),
which folder to resume from, pruning to ``total_limit``, and what a folder holds.

Accelerate prunes before it saves and resumes from the highest number even if that save never
finished. Here a folder counts once it holds a whole checkpoint (a committed bcp checkpoint, or
one written by accelerate's own engine): pruning runs after the commit, resuming skips folders
whose save was interrupted, and the iteration counter continues after the highest number so the
next save never collides with an existing folder.
"""

from __future__ import annotations

import enum
import os
import re

import accelerate
from accelerate.utils.constants import RNG_STATE_NAME

from bcp import CheckpointNotCommittedError
from bcp.integration import checkpoint_location
from bcp_accelerate import places

AUTOMATIC_DIR = "checkpoints"
#: Per save, accelerate's own files (schedulers, samplers, RNG, scaler, custom objects) go to a
#: fresh sub-folder named in the committed bcp checkpoint, so a save into an existing folder
#: replaces everything at the commit, never half of it.
FILES_DIR_PREFIX = "accelerate-"
_NUMBERED = re.compile(r"^checkpoint_(\d+)$")


class Contents(enum.Enum):
    """What a checkpoint folder holds."""

    COMMITTED = "a committed bcp checkpoint"
    ACCELERATE = "a checkpoint written by accelerate's own engine"
    INCOMPLETE = "no complete checkpoint: a save into it was interrupted, or it is not a checkpoint folder"


def contents(folder: str) -> Contents:
    location = checkpoint_location(folder, None)
    generations = location.generations()
    if any(location.is_committed(g) for g in generations):
        return Contents.COMMITTED
    names = places.names(folder)
    started_by_bcp = generations or any(name.startswith(FILES_DIR_PREFIX) for name in names)
    # Accelerate's engine writes the RNG states of every save, near the end.
    if not started_by_bcp and any(name.startswith(RNG_STATE_NAME) for name in names):
        return Contents.ACCELERATE
    return Contents.INCOMPLETE


def automatic_root(accelerator: accelerate.Accelerator) -> str:
    return places.join(accelerator.project_dir, AUTOMATIC_DIR)


def numbered(root: str) -> list[tuple[int, str]]:
    """``(n, path)`` of every ``checkpoint_<n>`` folder under ``root``, oldest first."""
    found = ((_NUMBERED.match(name), places.join(root, name)) for name in places.names(root))
    return sorted((int(match.group(1)), path) for match, path in found if match and places.is_folder(path))


def new_folder(accelerator: accelerate.Accelerator, output_dir: "str | os.PathLike | None") -> str:
    """The folder this save writes to. With automatic naming ``output_dir`` is ignored, as accelerate
    ignores it, and the numbered folder must not hold a checkpoint yet (the remains of an interrupted
    save are written over)."""
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state() needs an output_dir when automatic checkpoint naming is disabled")
        return os.fspath(output_dir)
    folder = places.join(automatic_root(accelerator), f"checkpoint_{config.iteration}")
    if places.exists(folder) and contents(folder) is not Contents.INCOMPLETE:
        raise ValueError(f"checkpoint folder {folder} already holds a checkpoint; set "
                         "accelerator.project_configuration.iteration to the number to continue from")
    return folder


def folder_to_load(accelerator: accelerate.Accelerator, input_dir: "str | os.PathLike | None") -> str:
    """``input_dir`` if given, else the newest automatically named folder holding a whole checkpoint."""
    if input_dir is not None:
        folder = os.fspath(input_dir)
        folder = folder if places.is_url(folder) else os.path.expanduser(folder)
        if not places.is_folder(folder):
            raise ValueError(f"load_state(): no such checkpoint folder {folder}")
        return folder
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("load_state() needs an input_dir when automatic checkpoint naming is disabled")
    root = automatic_root(accelerator)
    found = numbered(root)
    complete = [path for _, path in found if contents(path) is not Contents.INCOMPLETE]
    if not complete:
        raise CheckpointNotCommittedError(
            f"no checkpoint to resume from under {root}: "
            + (f"{', '.join(places.basename(p) for _, p in found)} hold no complete checkpoint" if found
               else "no checkpoint_<n> folder"))
    return complete[-1]


def continue_numbering(accelerator: accelerate.Accelerator) -> None:
    """After a resume, number the next automatic save after the highest existing folder."""
    config = accelerator.project_configuration
    existing = numbered(automatic_root(accelerator)) if config.automatic_checkpoint_naming else []
    if existing:
        config.iteration = max(config.iteration, existing[-1][0] + 1)


def prune(accelerator: accelerate.Accelerator, saved: str) -> None:
    """Once ``saved`` is committed, keep it and the newest other checkpoints up to ``total_limit``
    in all; folders holding no complete checkpoint go and do not count."""
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming or config.total_limit is None:
        return
    others = [path for _, path in numbered(automatic_root(accelerator)) if path != saved]
    incomplete = [path for path in others if contents(path) is Contents.INCOMPLETE]
    complete = [path for path in others if path not in incomplete]
    surplus = max(len(complete) - max(config.total_limit - 1, 0), 0)
    for path in incomplete + complete[:surplus]:
        places.remove(path)
