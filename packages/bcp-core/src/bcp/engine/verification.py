"""Verification: every chunk of stored bytes read is checked against the crc32c recorded for it."""

from __future__ import annotations

from bcp.engine.checksum import crc_of
from bcp.errors import CorruptCheckpointError
from bcp.layout.manifest import ByteRange


class ChunkVerifier:
    """Checks bytes of stored ranges of ``files`` against their ``chunk``-byte checksums."""

    def __init__(self, files: list[str], chunk: int, display: str) -> None:
        self.files = files
        self.chunk = chunk
        self.display = display

    def check(self, where: ByteRange, start: int, views: list[memoryview], key: str) -> None:
        """Verify the chunks of stored bytes read from ``start`` (a chunk boundary) into ``views``,
        one after another; the last chunk may end early only where the stored range does."""
        chunk = self.chunk
        index, crc, filled = start // chunk, 0, 0
        for view in views:
            at = 0
            while at < view.nbytes:
                take = min(chunk - filled, view.nbytes - at)
                crc = crc_of(view[at: at + take], crc)
                filled, at = filled + take, at + take
                if filled == chunk:
                    self._expect(where, index, crc, key)
                    index, crc, filled = index + 1, 0, 0
        if filled:
            self._expect(where, index, crc, key)

    def _expect(self, where: ByteRange, index: int, crc: int, key: str) -> None:
        if index >= len(where.crcs) or crc != where.crcs[index]:
            chunk = self.chunk
            at = where.offset + index * chunk
            raise CorruptCheckpointError(
                f"checksum mismatch in {self.files[where.file]} at bytes "
                f"[{at}, {at + min(chunk, where.nbytes - index * chunk)})", path=self.display, key=key)
