"""Counting the chunks a save compresses, to show which chunks were compressed and which were
referred to or copied as stored (in this process: synchronous saves and the tools, whose writer
threads code the chunks; not the writer process of an asynchronous save)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from bcp.engine import chunk_coding


@contextmanager
def compressed_chunks() -> Iterator[list[int]]:
    """A list that gets one entry (the chunk's raw length) per chunk coded while the block runs."""
    calls: list[int] = []
    original = chunk_coding.compress_chunk

    def counted(raw, *args, **kwargs):
        calls.append(raw.nbytes)
        return original(raw, *args, **kwargs)

    chunk_coding.compress_chunk = counted
    try:
        yield calls
    finally:
        chunk_coding.compress_chunk = original
