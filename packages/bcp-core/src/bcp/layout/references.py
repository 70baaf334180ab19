"""Data files of earlier generations (format version 3).

A generation's manifest lists its data files by name. Its own files are named inside its folder
(``data/00001-00.bin``); a file of an earlier generation of the same checkpoint path, whose bytes
an incremental save refers to instead of writing them again, is named from the checkpoint path:
``gen-00000003/data/00001-00.bin``. Such a name is the only way out of a generation's folder, and it
cannot leave the checkpoint path: the generation is eight digits and earlier than the manifest's
own, the rest is a plain relative name inside that generation's folder (no ``..``, no absolute
path, no further generation). A reference to a file that itself lies in an earlier generation is
that file's own name, so references are never chained.
"""

from __future__ import annotations

import re
from typing import Iterable

_EARLIER = re.compile(r"gen-(\d{8})/(.+)", re.DOTALL)


def generation_dir(generation: int) -> str:
    """The folder of ``generation`` under the checkpoint path."""
    return f"gen-{generation:08d}"


def earlier_file(generation: int, name: str) -> str:
    """How a later generation names file ``name`` of ``generation``'s manifest."""
    return name if referred_generation(name) is not None else f"{generation_dir(generation)}/{name}"


def referred_generation(name: str) -> int | None:
    """The earlier generation holding file ``name``, None for a file of the manifest's own generation."""
    match = _EARLIER.fullmatch(name)
    return int(match.group(1)) if match else None


def split_reference(name: str) -> tuple[int, str] | None:
    """``(generation, name inside its folder)`` of a file of an earlier generation, else None."""
    match = _EARLIER.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def copied_name(name: str) -> str:
    """The name inside a generation of its own that a copy of data file ``name`` takes: itself for
    a file of the generation, ``data/gen-00000003-00001-00.bin`` for ``gen-00000003/data/00001-00.bin``."""
    earlier = split_reference(name)
    if earlier is None:
        return name
    head, _, tail = earlier[1].rpartition("/")
    return f"{head or 'data'}/{generation_dir(earlier[0])}-{tail}"


def referred_generations(files: Iterable[str]) -> set[int]:
    """The earlier generations a manifest's ``files`` lie in."""
    return {g for g in map(referred_generation, files) if g is not None}
