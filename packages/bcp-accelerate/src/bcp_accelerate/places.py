"""Checkpoint folders named by a local path or by a URL (``s3://bucket/run``, ``memory://...``).

A local folder is handled with ``os`` as before. A URL folder lives in bcp's storage: its "sub-folders"
are key prefixes, nothing needs creating, and accelerate's own files (which accelerate writes and
reads with local file functions) are staged in a local temporary folder and copied to or from the
checkpoint's storage in one piece per file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from bcp.integration import is_url, storage_for


def join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if is_url(folder) else os.path.join(folder, name)


def basename(folder: str) -> str:
    return folder.rstrip("/").rsplit("/", 1)[-1] if is_url(folder) else os.path.basename(folder)


def make(folder: str) -> None:
    """Create a local folder; a URL folder needs nothing (it exists once something is written under it)."""
    if not is_url(folder):
        os.makedirs(folder, exist_ok=True)


def exists(folder: str) -> bool:
    return storage_for(folder).exists("") if is_url(folder) else os.path.exists(folder)


def is_folder(folder: str) -> bool:
    """A local directory, or a URL prefix with something under it."""
    return bool(storage_for(folder).list_dir("")) if is_url(folder) else os.path.isdir(folder)


def names(folder: str) -> list[str]:
    """The names directly in ``folder`` (files and sub-folders); none if it does not exist."""
    if is_url(folder):
        return storage_for(folder).list_dir("")
    return os.listdir(folder) if os.path.isdir(folder) else []


def remove(folder: str) -> None:
    """Remove ``folder`` and everything in it; absent is not an error."""
    if is_url(folder):
        storage_for(folder).delete_tree("")
    else:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def files_to_write(folder: str) -> Iterator[str]:
    """A local folder to write files into that end up in ``folder``: ``folder`` itself when it is
    local, else a temporary folder whose files are uploaded to ``folder`` when the block ends."""
    if not is_url(folder):
        os.makedirs(folder, exist_ok=True)
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="bcp-accelerate-") as staging:
        yield staging
        storage = storage_for(folder)
        for name in sorted(os.listdir(staging)):
            with open(os.path.join(staging, name), "rb") as source:
                storage.write_file(name, [memoryview(source.read())])


@contextlib.contextmanager
def files_to_read(folder: str) -> Iterator[str]:
    """A local folder holding the files of ``folder``: itself when local, else a temporary copy."""
    if not is_url(folder):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="bcp-accelerate-") as staging:
        storage = storage_for(folder)
        for name in storage.list_dir(""):
            with open(os.path.join(staging, name), "wb") as copy:
                copy.write(storage.read_bytes(name))
        yield staging
