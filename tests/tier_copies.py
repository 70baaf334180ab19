"""Copies of a saved memory tier with nodes lost, for the integrations' memory-tier tests: a tier
saved under ``<root>/run`` (``local_dir=<root>/run/shm``, ``persistent=<root>/run/persistent``) is
copied to ``<root>/<name>``, and the copy loses the named nodes' folders, and its persistent
checkpoint unless kept (so that a load from the copy cannot have read storage)."""

from __future__ import annotations

import shutil


def copy_losing(root: str, name: str, lost: tuple[str, ...], persistent: bool) -> str:
    """The copy's root folder."""
    copy = f"{root}/{name}"
    shutil.copytree(f"{root}/run", copy)
    for node in lost:
        shutil.rmtree(f"{copy}/shm/node-{node}")
    if not persistent:
        shutil.rmtree(f"{copy}/persistent")
    return copy
