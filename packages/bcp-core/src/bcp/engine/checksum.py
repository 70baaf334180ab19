"""Checksums: crc32c (Castagnoli, hardware-accelerated, also what object stores verify), one per
fixed-size chunk of each stored byte range, so a partial read can verify just the chunks it spans."""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

from crc32c import crc32c


def chunk_crcs(data: memoryview, chunk: int) -> list[int]:
    if data.nbytes <= chunk:  # one chunk (also an empty range): the common case for small tensors
        return [crc32c(data)]
    return [crc32c(data[i: i + chunk]) for i in range(0, data.nbytes, chunk)]


def crc_of(data: memoryview, previous: int = 0) -> int:
    """The crc32c of ``data``; with ``previous``, that of the bytes before it followed by ``data``."""
    return crc32c(data, previous)


def joined_chunk_crcs(parts: Sequence[memoryview | bytes], chunk: int) -> list[int]:
    """``chunk_crcs`` of the bytes of ``parts`` one after the other, without joining them."""
    crcs: list[int] = []
    crc, filled = 0, 0
    for part in parts:
        view = memoryview(part)
        at = 0
        while at < view.nbytes:
            take = min(chunk - filled, view.nbytes - at)
            crc = crc32c(view[at: at + take], crc)
            filled += take
            at += take
            if filled == chunk:
                crcs.append(crc)
                crc, filled = 0, 0
    if filled or not crcs:  # the last, shorter chunk (an empty range has one crc, of zero bytes)
        crcs.append(crc)
    return crcs


def content_digest(crcs: Sequence[int], *described: object) -> int:
    """A 64-bit digest of bytes whose chunk crcs are ``crcs``, and of what ``described`` says of
    them (dtype, shape, ...): compares the bytes of ranks without another pass over them."""
    h = hashlib.blake2b(array("I", crcs).tobytes(), digest_size=8)
    h.update(repr(described).encode())
    return int.from_bytes(h.digest(), "big")
