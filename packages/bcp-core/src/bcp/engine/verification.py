"""Verification: every chunk of stored bytes read is checked against the crc32c recorded for it;
compressed chunks are decoded here too, between the checks of their stored and their raw bytes."""

from __future__ import annotations

from collections.abc import Callable

from bcp.chunk_codecs import ChunkDecodeError, decompress_chunk
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


class ChunkDecoder:
    """Decodes compressed chunks of stored ranges of ``files`` (format version 4, ``chunk``-byte
    chunks). Where ``verify``, each chunk's stored bytes are checked against their crc32c before it
    is decoded, and its raw bytes against theirs after; a chunk that does not decode to exactly its
    raw length is refused either way, naming the tensor and the chunk."""

    def __init__(self, files: list[str], chunk: int, verify: bool, display: str) -> None:
        self.files = files
        self.chunk = chunk
        self.verify = verify
        self.display = display

    def decode(self, where: ByteRange, first: int, end: int, width: int, stored: memoryview,
               dests: list[memoryview], key: str) -> None:
        """Decode chunks ``[first, end)`` of ``where`` from their ``stored`` bytes (read from the
        first one's start) into ``dests``, one after another."""
        chunks, outs = where.stored, _consecutive(dests)
        for index, data in zip(range(first, end), _chunks_of(where, first, end, stored)):
            raw_nbytes = min(self.chunk, where.nbytes - index * self.chunk)
            if self.verify:
                self._check(where, index, data, key)
            targets = outs(raw_nbytes)
            target = targets[0] if len(targets) == 1 else memoryview(bytearray(raw_nbytes))
            try:
                decompress_chunk(data, chunks.codecs[index], width, target)
            except ChunkDecodeError as exc:
                raise self._corrupt(where, index, f"does not decode to its {raw_nbytes} bytes ({exc})", key) from None
            if self.verify and crc_of(target) != where.crcs[index]:
                raise self._corrupt(where, index, "decodes to bytes that do not match their checksum", key)
            if len(targets) > 1:
                at = 0
                for view in targets:
                    view[:] = target[at: at + view.nbytes]
                    at += view.nbytes

    def check_stored(self, where: ByteRange, first: int, end: int, stored: memoryview, key: str) -> None:
        """Check chunks ``[first, end)`` of ``where`` against the checksums of their ``stored`` bytes
        (read from the first one's start), without decoding them."""
        for index, data in zip(range(first, end), _chunks_of(where, first, end, stored)):
            self._check(where, index, data, key)

    def _check(self, where: ByteRange, index: int, data: memoryview, key: str) -> None:
        if crc_of(data) != where.stored.crcs[index]:
            raise self._corrupt(where, index, "does not match the checksum of its stored bytes", key)

    def _corrupt(self, where: ByteRange, index: int, what: str, key: str) -> CorruptCheckpointError:
        starts = where.stored.starts()
        at = where.offset + starts[index]
        return CorruptCheckpointError(
            f"compressed chunk {index} in {self.files[where.file]} at bytes [{at}, {where.offset + starts[index + 1]}) "
            f"{what}", path=self.display, key=key)


def _chunks_of(where: ByteRange, first: int, end: int, stored: memoryview) -> list[memoryview]:
    """The stored bytes of chunks ``[first, end)`` of ``where``, cut from ``stored`` (read from the
    first one's start)."""
    starts = where.stored.starts()
    return [stored[starts[index] - starts[first]: starts[index + 1] - starts[first]] for index in range(first, end)]


def _consecutive(views: list[memoryview]) -> Callable[[int], list[memoryview]]:
    """A function handing out the next ``n`` bytes of ``views`` (one after another) as views."""
    position = [0, 0]  # the view, and the byte within it

    def take(nbytes: int) -> list[memoryview]:
        out = []
        while nbytes:
            view = views[position[0]]
            piece = view[position[1]: position[1] + nbytes]
            out.append(piece)
            nbytes -= piece.nbytes
            position[1] += piece.nbytes
            if position[1] == view.nbytes:
                position[0], position[1] = position[0] + 1, 0
        return out or [memoryview(bytearray())]
    return take
