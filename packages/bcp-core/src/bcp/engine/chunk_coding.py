"""The writer's side of compression (format version 4): a piece's raw bytes in, as the views the
writer streams them in, its stored chunks out, one coded chunk at a time, with what the shard table
records of each (codec, stored length, crc32c of the stored bytes). The writer threads and the
writer process both code with it, after staging, so an asynchronous save blocks no longer for it.

Imports no torch: the writer process uses it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from bcp.chunk_codecs import RAW, compress_chunk
from bcp.engine.checksum import crc_of


class ItemCoder:
    """Codes one item's chunks of ``chunk`` bytes with ``codec`` (planes of ``width`` bytes) at
    ``level``. A raw chunk smaller than ``copy_below`` is handed on as a copy: the memory of the view
    it lies in may be reused once the next one is asked for (``ChunkedCopies.write_views``), and
    the storage promises to be done with a chunk by then only from that size on."""

    def __init__(self, codec: int, width: int, level: int, chunk: int, copy_below: int | None) -> None:
        self.codec, self.width, self.level, self.chunk = codec, width, level, chunk
        self.copy_below = copy_below
        self.codecs: list[int] = []
        self.nbytes: list[int] = []
        self.crcs: list[int] = []

    def code(self, data: memoryview, raw_crcs: Sequence[int]) -> Iterator[memoryview]:
        """The stored chunks of ``data``, the item's next bytes (from a chunk boundary, whole chunks
        but for the item's last); ``raw_crcs`` are the item's raw chunk checksums, those of ``data``
        among them."""
        if data.nbytes == 0 and not self.codecs:  # an empty item: one raw chunk of no bytes
            self._record(RAW, data, raw_crcs)
            yield data
        for at in range(0, data.nbytes, self.chunk):
            raw = data[at: at + self.chunk]
            codec, stored = compress_chunk(raw, self.codec, self.width, self.level)
            self._record(codec, stored, raw_crcs)
            if codec == RAW and self.copy_below is not None and raw.nbytes < self.copy_below:
                stored = memoryview(raw.tobytes())
            yield stored

    def _record(self, codec: int, stored: memoryview, raw_crcs: Sequence[int]) -> None:
        self.codecs.append(codec)
        self.nbytes.append(stored.nbytes)
        # a raw chunk's stored crc is its raw crc, known already
        self.crcs.append(raw_crcs[len(self.crcs)] if codec == RAW else crc_of(stored))
