"""Checksums: crc32c (Castagnoli, hardware-accelerated, also what object stores verify), one per
fixed-size chunk of each stored byte range, so a partial read can verify just the chunks it spans."""

from __future__ import annotations

from crc32c import crc32c


def chunk_crcs(data: memoryview, chunk: int) -> list[int]:
    if data.nbytes <= chunk:  # one chunk (also an empty range): the common case for small tensors
        return [crc32c(data)]
    return [crc32c(data[i: i + chunk]) for i in range(0, data.nbytes, chunk)]


def crc_of(data: memoryview, previous: int = 0) -> int:
    """The crc32c of ``data``; with ``previous``, that of the bytes before it followed by ``data``."""
    return crc32c(data, previous)
