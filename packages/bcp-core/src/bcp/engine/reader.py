"""Reading: byte ranges of saved shards straight into destination memory where the layouts allow
it, through a scratch buffer where they do not, verifying the checksum of every chunk read."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable

import torch

from bcp.engine.bytes_of import byte_view
from bcp.engine.checksum import crc_of
from bcp.engine.location import Location
from bcp.errors import CorruptCheckpointError, StorageError
from bcp.layout.box import Box, contiguous_span, is_contiguous_in, row_major_strides
from bcp.layout.manifest import ByteRange, Manifest, ObjectEntry
from bcp.layout.values import decode_value
from bcp.planning.load_plan import ReadOp


# A direct read larger than this is split into parts read by several threads.
READ_PART_BYTES = 64 << 20


class ShardReader:
    """Reads from one committed generation of a checkpoint."""

    def __init__(self, location: Location, generation: int, manifest: Manifest, *, verify: bool = True) -> None:
        self.location = location
        self.generation = generation
        self.manifest = manifest
        self.verify = verify
        self.display = f"{location.display}/gen-{generation:08d}"
        self.bytes_read = 0
        self._count_lock = threading.Lock()

    def run(self, ops: list[ReadOp], threads: int) -> None:
        tasks = [task for op in ops for task in self.tasks(op)]
        if not tasks:
            return
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(tasks))), thread_name_prefix="bcp-read") as pool:
            for future in [pool.submit(task) for task in tasks]:
                future.result()

    def tasks(self, op: ReadOp) -> list[Callable[[], None]]:
        """How to execute one read: straight into the destination's memory when the saved bytes
        are exactly its bytes (split into parts, so one large shard is read by several threads),
        else through a scratch buffer and a strided copy."""
        shard, piece = op.shard, op.piece
        itemsize = piece.tensor.element_size()
        inner = op.region.relative_to(shard.box)
        first, end = contiguous_span(inner, shard.box.lengths)
        start_byte, end_byte = self._span(shard.bytes, first * itemsize, end * itemsize)
        direct = (
            op.region == piece.box and piece.tensor.device.type == "cpu" and piece.tensor.is_contiguous()
            and is_contiguous_in(inner, shard.box.lengths)
            and (start_byte, end_byte) == (first * itemsize, end * itemsize)
        )
        if not direct:
            return [partial(self._through_scratch, op, inner, first, start_byte, end_byte)]
        view = byte_view(piece.tensor)
        step = -(-READ_PART_BYTES // self.manifest.checksum_chunk) * self.manifest.checksum_chunk
        return [partial(self.read_range, shard.bytes, start_byte + at, view[at: at + step], piece.name)
                for at in range(0, max(1, view.nbytes), step)]

    def _through_scratch(self, op: ReadOp, inner: Box, first: int, start_byte: int, end_byte: int) -> None:
        piece, shard = op.piece, op.shard
        scratch = torch.empty(end_byte - start_byte, dtype=torch.uint8)
        self.read_range(shard.bytes, start_byte, byte_view(scratch), piece.name)
        values = scratch.view(piece.tensor.dtype)
        at = first - start_byte // piece.tensor.element_size()
        source = values.as_strided(inner.lengths, row_major_strides(shard.box.lengths), at)
        piece.tensor[op.region.relative_to(piece.box).slices()].copy_(source)

    def _span(self, where: ByteRange, start: int, end: int) -> tuple[int, int]:
        """The bytes to read for ``[start, end)`` of a stored range: widened to whole checksum
        chunks when verifying, since a chunk's crc covers all of it."""
        if not self.verify:
            return start, end
        chunk = self.manifest.checksum_chunk
        return start - start % chunk, min(where.nbytes, -(-end // chunk) * chunk)

    def read_range(self, where: ByteRange, start: int, dest: memoryview, key: str) -> None:
        """Read ``dest.nbytes`` bytes from ``start`` of a stored range (chunk-aligned when verifying)."""
        file = self.manifest.files[where.file]
        if start + dest.nbytes > where.nbytes:
            raise CorruptCheckpointError(f"read beyond the stored range in {file}", path=self.display, key=key)
        try:
            self.location.storage.read_into(self.location.name(self.generation, file), where.offset + start, dest)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {file} is missing", path=self.display, key=key) from None
        except EOFError:
            raise CorruptCheckpointError(f"data file {file} is truncated", path=self.display, key=key) from None
        except OSError as exc:
            raise StorageError(f"reading {file} failed: {exc}", path=self.display, key=key) from exc
        with self._count_lock:
            self.bytes_read += dest.nbytes
        if self.verify:
            self._check(where, start, dest, file, key)

    def _check(self, where: ByteRange, start: int, data: memoryview, file: str, key: str) -> None:
        chunk = self.manifest.checksum_chunk
        first = start // chunk
        for i in range(0, data.nbytes, chunk):
            index = first + i // chunk
            if index >= len(where.crcs) or crc_of(data[i: i + chunk]) != where.crcs[index]:
                at = where.offset + start + i
                raise CorruptCheckpointError(
                    f"checksum mismatch in {file} at bytes [{at}, {at + min(chunk, data.nbytes - i)})",
                    path=self.display, key=key)

    def read_object(self, entry: ObjectEntry, rank: int, *, allow_pickle: bool) -> Any:
        where, tree_nbytes = entry.records[entry.ranks[rank]]
        buffer = bytearray(where.nbytes)
        self.read_range(where, 0, memoryview(buffer), entry.name)
        return decode_value(memoryview(buffer), tree_nbytes, key=entry.name, path=self.display,
                            allow_pickle=allow_pickle)
