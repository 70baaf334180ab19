"""The paths Lightning hands to a checkpoint plugin: what saving over one replaces, how one is
removed, which are Lightning's own single-file checkpoints, and clear errors for checkpoints in
Lightning's sharded format.

A bcp checkpoint is a directory. Lightning rewrites ``last.ckpt`` at the same path (bcp makes a new
generation there) and, with ``ModelCheckpoint(save_last="link")``, makes it a symbolic link to
another checkpoint: saving through such a link would write into the linked checkpoint, so the
link is replaced instead.
"""

from __future__ import annotations

import os
import shutil

import bcp
from bcp.integration import is_url, storage_for

#: A directory holding this file is a checkpoint in Lightning's own sharded format.
LIGHTNING_SHARDED_MARKER = "meta.pt"


def local_path(path: str) -> str | None:
    """The file-system path of a local checkpoint path, None for other storage (``s3://...``)."""
    if path.startswith("file://"):
        return path[len("file://"):]
    return None if is_url(path) else path


def prepare_for_save(path: str) -> None:
    """Make room for a checkpoint at ``path``, as Lightning's own savers overwrite: a link, a file
    or a checkpoint in Lightning's sharded format there is removed; a bcp checkpoint stays (the
    save adds a generation). Call on one rank, before that rank joins the save."""
    local = local_path(path)
    if local is None:
        return
    if os.path.islink(local) or os.path.isfile(local):
        os.unlink(local)
    elif is_lightning_sharded(local):
        shutil.rmtree(local)


def remove(path: str) -> None:
    """Remove the checkpoint at ``path``; a link is removed, not what it points to."""
    local = local_path(path)
    if local is None:
        storage_for(path).delete_tree("")
    elif os.path.islink(local) or os.path.isfile(local):
        os.unlink(local)
    elif is_lightning_sharded(local):
        raise bcp.CheckpointError(
            "BCPCheckpointIO was asked to remove a checkpoint in Lightning's own sharded format (it holds "
            f"{LIGHTNING_SHARDED_MARKER}): FSDPStrategy and ModelParallelStrategy save sharded checkpoints with "
            "torch.distributed.checkpoint and never call the CheckpointIO plugin. Use bcp_lightning's "
            "BCPFSDPStrategy or BCPModelParallelStrategy instead, which save through bcp", path=path)
    elif os.path.isdir(local):
        shutil.rmtree(local)


def is_single_file(path: str) -> bool:
    """Whether ``path`` is a single-file checkpoint (Lightning's ``TorchCheckpointIO`` writes those)."""
    local = local_path(path)
    return local is not None and os.path.isfile(local)


def check_loadable(path: str) -> None:
    """Refuse, with the way out, checkpoints in Lightning's sharded format."""
    local = local_path(path)
    if local is None:
        return
    if is_lightning_sharded(local):
        raise bcp.CheckpointNotFoundError(
            f"this is a checkpoint in Lightning's own sharded format ({LIGHTNING_SHARDED_MARKER}); load it with "
            "Lightning's FSDPStrategy or ModelParallelStrategy, then save it again through bcp", path=path)


def is_lightning_sharded(local: str) -> bool:
    return os.path.isdir(local) and os.path.isfile(os.path.join(local, LIGHTNING_SHARDED_MARKER))
