"""Reading: byte ranges of saved shards straight into destination memory where the layouts allow
it, through a scratch buffer where they do not, verifying the checksum of every chunk read.

Read ops whose saved bytes are contiguous runs of their destinations become *runs*; runs back to
back in one stored range (the boxes of a flat FSDP/ZeRO shard) are merged into one, so they are read
as one stretch of the file into several buffers. A run is read straight into the destinations in
parts of at most ``READ_PART_BYTES``; when verifying, the partly wanted checksum chunks at its two
ends go through scratch memory, read whole. Other ops (a strided region of a shard) are read
through scratch in whole chunks of ``SCRATCH_PART_BYTES`` and their wanted elements copied out.
Segments that lie back to back in one file (small tensors are stored so) are read with one
vectored read, and each segment is verified right after it is read, while its bytes are likely
still in the CPU cache. A few worker threads take these batches from per-file lanes: each worker
streams through a file of its own, in file order, as a raw parallel read of the files would, and
helps with the fullest lane once its own is empty.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from bcp.engine.bytes_of import byte_view
from bcp.engine.checksum import crc_of
from bcp.engine.location import Location
from bcp.errors import CorruptCheckpointError, StorageError
from bcp.layout.box import Box, contiguous_span, flat_range_to_boxes, row_major_strides
from bcp.layout.manifest import ByteRange, Manifest, ObjectEntry
from bcp.layout.values import decode_value
from bcp.planning.load_plan import ReadOp
from bcp.planning.pieces import Piece

# Parts of a direct read (rounded to whole checksum chunks when verifying): large enough to
# stream, small enough to spread a large shard over the threads. Each part is verified right after
# it is read, mostly from the last-level cache; reading and verifying one chunk at a time was
# measured no faster (105 MiB L3) and a little slower without verification.
READ_PART_BYTES = 64 << 20
# Parts of a read through scratch memory (whole chunks, trimmed to those holding wanted bytes), so
# each worker's scratch stays small and the wanted elements are copied out while still in cache.
SCRATCH_PART_BYTES = 4 << 20
# At most this many segments per vectored read (Linux's IOV_MAX).
BATCH_SEGMENTS = 1024
# Scratch slots start on cache lines, so any dtype can view them.
_SLOT_ALIGN = 64


@dataclass(slots=True)
class _Progress:
    """The read ops a group of segments fills, and how many of those segments are not yet in place."""

    ops: list[ReadOp]
    left: int


@dataclass(slots=True)
class _Segment:
    """Bytes ``[start, start + nbytes)`` of a stored range, read into ``dests`` one after another,
    or, when ``dests`` is None, into scratch memory out of which ``place`` copies the wanted bytes."""

    where: ByteRange
    start: int
    nbytes: int
    dests: list[memoryview] | None
    place: Callable[[torch.Tensor], None] | None
    progress: _Progress

    @property
    def position(self) -> tuple[int, int]:
        """Where the segment lies: (file index, byte offset in the file)."""
        return self.where.file, self.where.offset + self.start

    @property
    def key(self) -> str:
        """The tensor whose bytes these are, for errors."""
        return self.progress.ops[0].piece.name


@dataclass(slots=True)
class _Run:
    """Bytes ``[low, high)`` of a stored range that belong, in order, in ``dests`` (each a
    contiguous run of a destination), filling ``ops`` (all of one stored tensor, so one dtype)."""

    where: ByteRange
    low: int
    high: int
    dests: list[memoryview]
    ops: list[ReadOp]

    def dests_for(self, low: int, high: int) -> list[memoryview]:
        """The destination memory of stored bytes ``[low, high)`` of the run."""
        out, at = [], self.low
        for dest in self.dests:
            start, end = max(low, at), min(high, at + dest.nbytes)
            if start < end:
                out.append(dest[start - at: end - at])
            at += dest.nbytes
        return out


class ShardReader:
    """Reads from one committed generation of a checkpoint."""

    def __init__(self, location: Location, generation: int, manifest: Manifest, *, verify: bool = True) -> None:
        self.location = location
        self.generation = generation
        self.manifest = manifest
        self.verify = verify
        self.display = f"{location.display}/gen-{generation:08d}"
        self.bytes_read = 0
        self._lock = threading.Lock()

    def run(self, ops: list[ReadOp], threads: int, on_done: Callable[[ReadOp], None] | None = None) -> None:
        """Execute ``ops`` on up to ``threads`` threads; ``on_done(op)`` (on a worker thread) once
        each op's bytes are in place."""
        batches = _batches(self._segments(ops))
        if not batches:
            return
        lanes, stop = _Lanes(batches), threading.Event()
        workers = max(1, min(threads, len(batches)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bcp-read") as pool:
            futures = [pool.submit(self._work, lanes, worker, stop, on_done) for worker in range(workers)]
            for future in futures:
                future.result()

    def read_each(self, ops: list[ReadOp], threads: int) -> Iterator[ReadOp]:
        """Execute ``ops``, yielding each on the calling thread as soon as its bytes are in place
        (read-once sends them on to other ranks meanwhile)."""
        finished: queue.SimpleQueue = queue.SimpleQueue()
        failure: list[BaseException] = []

        def execute() -> None:
            try:
                self.run(ops, threads, finished.put)
            except BaseException as exc:  # noqa: BLE001 - handed to the calling thread, which raises it
                failure.append(exc)
            finally:
                finished.put(None)

        runner = threading.Thread(target=execute, name="bcp-read-each", daemon=True)
        runner.start()
        try:
            while (op := finished.get()) is not None:
                yield op
        finally:
            runner.join()
        if failure:
            raise failure[0]

    def _segments(self, ops: list[ReadOp]) -> list[_Segment]:
        """How to execute the reads: runs straight into destination memory (merged where back to
        back in a stored range), strided regions through scratch."""
        segments: list[_Segment] = []
        runs: list[_Run] = []
        for op in ops:
            shard, piece = op.shard, op.piece
            if shard.bytes.nbytes <= READ_PART_BYTES and _is_whole_copy(op):  # the common case, kept cheap
                view = byte_view(piece.tensor)
                segments.append(_Segment(shard.bytes, 0, view.nbytes, [view], None, _Progress([op], 1)))
                continue
            itemsize = piece.tensor.element_size()
            inner, first, end = _in_shard(op, itemsize)
            if end * itemsize > shard.bytes.nbytes:
                raise CorruptCheckpointError(
                    f"read beyond the stored range in {self.manifest.files[shard.bytes.file]}",
                    path=self.display, key=piece.name)
            destination = _direct_destination(op, end - first)
            if destination is None:
                segments += self._strided_segments(op, inner, first, end)
            else:
                runs.append(_Run(shard.bytes, first * itemsize, end * itemsize, [destination], [op]))
        for run in _merged(runs):
            segments += self._run_segments(run)
        return segments

    def _run_segments(self, run: _Run) -> list[_Segment]:
        """A run in parts straight into its destinations. When verifying, a direct part starts and
        ends on checksum chunks (or the end of the stored range): a partly wanted chunk at either
        end of the run is read whole into scratch and its wanted bytes copied out."""
        where, align = run.where, self._alignment(run.ops[0].piece.tensor.element_size())
        direct_low = -(-run.low // align) * align
        direct_high = run.high if run.high == where.nbytes else run.high // align * align
        progress = _Progress(run.ops, 0)
        segments: list[_Segment] = []
        through_scratch = [(run.low, run.high)]
        if direct_low < direct_high:
            step = _multiple(READ_PART_BYTES, align)
            for at in range(direct_low, direct_high, step):
                part_end = min(at + step, direct_high)
                segments.append(_Segment(where, at, part_end - at, run.dests_for(at, part_end), None, progress))
            through_scratch = [(run.low, direct_low), (direct_high, run.high)]
        step = _multiple(SCRATCH_PART_BYTES, align)
        for low, high in through_scratch:
            if low >= high:
                continue
            start, end = _widened(low, high, align, where.nbytes)
            for at in range(start, end, step):
                part_end = min(at + step, end)
                wanted_low, wanted_high = max(at, low), min(part_end, high)
                place = partial(_copy_bytes, run.dests_for(wanted_low, wanted_high), wanted_low - at)
                segments.append(_Segment(where, at, part_end - at, None, place, progress))
        progress.left = len(segments)
        return segments

    def _strided_segments(self, op: ReadOp, inner: Box, first: int, end: int) -> list[_Segment]:
        """A region whose saved bytes are not one run of its destination: the stored elements
        ``[first, end)`` it spans, in whole chunks through scratch, each part copying the region's
        elements it holds into place (a part holding none is not read)."""
        shard, itemsize = op.shard, op.piece.tensor.element_size()
        align = self._alignment(itemsize)
        start_byte, end_byte = _widened(first * itemsize, end * itemsize, align, shard.bytes.nbytes)
        progress = _Progress([op], 0)
        segments, step = [], _multiple(SCRATCH_PART_BYTES, align)
        for at in range(start_byte, end_byte, step):
            part_end = min(at + step, end_byte)
            boxes = _wanted_in(inner, shard.box.lengths, at // itemsize, part_end // itemsize, (first, end))
            if boxes:  # the part, trimmed to the chunks its wanted elements lie in
                spans = [contiguous_span(box, shard.box.lengths) for box in boxes]
                low, high = _widened(min(lo for lo, _ in spans) * itemsize, max(hi for _, hi in spans) * itemsize,
                                     align, part_end)
                place = partial(_copy_out, op.piece, shard.box, boxes, low // itemsize)
                segments.append(_Segment(shard.bytes, low, high - low, None, place, progress))
        progress.left = len(segments)
        return segments

    def _alignment(self, itemsize: int) -> int:
        """What segment boundaries are multiples of (within a stored range): whole elements, and
        whole checksum chunks when verifying, since a chunk's crc covers all of it."""
        return math.lcm(self.manifest.checksum_chunk, itemsize) if self.verify else itemsize

    def _work(self, lanes: _Lanes, worker: int, stop: threading.Event,
              on_done: Callable[[ReadOp], None] | None) -> None:
        """One worker: batches until none is left or another worker failed."""
        scratch, lane = _Scratch(), worker
        try:
            while not stop.is_set() and (taken := lanes.take(lane)) is not None:
                batch, lane = taken
                self._read_batch(batch, scratch, on_done)
        except BaseException:
            stop.set()
            raise

    def _read_batch(self, batch: list[_Segment], scratch: _Scratch, on_done: Callable[[ReadOp], None] | None) -> None:
        slots = scratch.slots(batch)
        views = [s.dests if s.dests is not None else [byte_view(slot)] for s, slot in zip(batch, slots)]
        self._fill(batch, views)
        for segment, segment_views, slot in zip(batch, views, slots):
            if self.verify:
                self._check(segment.where, segment.start, segment_views, segment.key)
            if segment.place is not None:
                segment.place(slot)
            if on_done is not None and self._last_of_group(segment.progress):
                for op in segment.progress.ops:
                    on_done(op)

    def _last_of_group(self, progress: _Progress) -> bool:
        """Count one more segment in place; whether it was the last of its group."""
        with self._lock:
            progress.left -= 1
            return progress.left == 0

    def _fill(self, batch: list[_Segment], views: list[list[memoryview]]) -> None:
        """One vectored read of a batch; if it fails, its segments one by one, so that the error
        names the tensor whose bytes are missing."""
        first = batch[0]
        try:
            self._read_into(first.where, first.start, [v for vs in views for v in vs], first.key)
        except (CorruptCheckpointError, StorageError):
            if len(batch) == 1:
                raise
            for segment, segment_views in zip(batch, views):
                self._read_into(segment.where, segment.start, segment_views, segment.key)

    def read_range(self, where: ByteRange, start: int, dest: memoryview, key: str) -> None:
        """Read ``dest.nbytes`` bytes from ``start`` of a stored range (chunk-aligned when verifying)."""
        if start + dest.nbytes > where.nbytes:
            raise CorruptCheckpointError(f"read beyond the stored range in {self.manifest.files[where.file]}",
                                         path=self.display, key=key)
        self._read_into(where, start, [dest], key)
        if self.verify:
            self._check(where, start, [dest], key)

    def _read_into(self, where: ByteRange, start: int, views: list[memoryview], key: str) -> None:
        """Consecutive bytes of a stored file from ``start`` of ``where`` into ``views``."""
        file = self.manifest.files[where.file]
        try:
            self.location.storage.read_into_many(self.location.name(self.generation, file), where.offset + start, views)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {file} is missing", path=self.display, key=key) from None
        except EOFError:
            raise CorruptCheckpointError(f"data file {file} is truncated", path=self.display, key=key) from None
        except OSError as exc:
            raise StorageError(f"reading {file} failed: {exc}", path=self.display, key=key) from exc
        with self._lock:
            self.bytes_read += sum(view.nbytes for view in views)

    def _check(self, where: ByteRange, start: int, views: list[memoryview], key: str) -> None:
        """Verify the chunks of stored bytes read from ``start`` (a chunk boundary) into ``views``,
        one after another; the last chunk may end early only where the stored range does."""
        chunk = self.manifest.checksum_chunk
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
            chunk = self.manifest.checksum_chunk
            at = where.offset + index * chunk
            raise CorruptCheckpointError(
                f"checksum mismatch in {self.manifest.files[where.file]} at bytes "
                f"[{at}, {at + min(chunk, where.nbytes - index * chunk)})", path=self.display, key=key)

    def read_object(self, entry: ObjectEntry, rank: int, *, allow_pickle: bool) -> Any:
        where, tree_nbytes = entry.records[entry.ranks[rank]]
        buffer = bytearray(where.nbytes)
        self.read_range(where, 0, memoryview(buffer), entry.name)
        return decode_value(memoryview(buffer), tree_nbytes, key=entry.name, path=self.display,
                            allow_pickle=allow_pickle)


class _Lanes:
    """Batches grouped by file, each group in file order. Worker ``i`` starts on the ``i``-th file
    (modulo their number) and keeps to its lane; an empty lane sends it to the one with the most
    bytes left. Streaming whole files per worker measured about 10% faster on cold reads here than
    all workers sharing one file-ordered list (which puts them side by side in one file)."""

    def __init__(self, batches: list[list[_Segment]]) -> None:
        by_file: dict[int, deque[list[_Segment]]] = {}
        for batch in batches:
            by_file.setdefault(batch[0].where.file, deque()).append(batch)
        self._lanes = list(by_file.values())
        self._left = [sum(s.nbytes for batch in lane for s in batch) for lane in self._lanes]
        self._lock = threading.Lock()

    def take(self, lane: int) -> tuple[list[_Segment], int] | None:
        """The next batch for a worker on ``lane`` and the lane it came from; None when all are done."""
        with self._lock:
            lane %= len(self._lanes)
            if not self._lanes[lane]:
                lane = max(range(len(self._lanes)), key=self._left.__getitem__)
                if not self._lanes[lane]:
                    return None
            batch = self._lanes[lane].popleft()
            self._left[lane] -= sum(s.nbytes for s in batch)
            return batch, lane


class _Scratch:
    """A worker's reusable scratch memory: a batch's scratch segments get consecutive slots."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def slots(self, batch: list[_Segment]) -> list[torch.Tensor | None]:
        sizes = [-(-s.nbytes // _SLOT_ALIGN) * _SLOT_ALIGN if s.dests is None else 0 for s in batch]
        if sum(sizes) > self.buffer.numel():
            self.buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        slots: list[torch.Tensor | None] = []
        at = 0
        for segment, size in zip(batch, sizes):
            slots.append(self.buffer[at: at + segment.nbytes] if segment.dests is None else None)
            at += size
        return slots


def _widened(low: int, high: int, align: int, limit: int) -> tuple[int, int]:
    """Bytes ``[low, high)`` widened to multiples of ``align`` (whole checksum chunks), the end
    capped at ``limit`` (the end of the stored range, whose last chunk may be short)."""
    return low // align * align, min(limit, -(-high // align) * align)


def _multiple(nbytes: int, align: int) -> int:
    """``nbytes`` rounded to a positive multiple of ``align``."""
    return max(1, nbytes // align) * align


def _in_shard(op: ReadOp, itemsize: int) -> tuple[Box, int, int]:
    """The op's region in its shard's coordinates, and the range ``[first, end)`` of the shard's
    row-major elements that it spans."""
    shard = op.shard.box
    if op.region == shard:  # the whole shard, as when loading into the saved layout
        return Box((0,) * shard.ndim, shard.lengths), 0, op.shard.bytes.nbytes // itemsize
    inner = op.region.relative_to(shard)
    first, end = contiguous_span(inner, shard.lengths)
    return inner, first, end


def _direct_destination(op: ReadOp, span: int) -> memoryview | None:
    """The destination bytes holding the op's region, when the region fills the ``span`` elements
    it spans in the shard and is one contiguous run of a contiguous CPU destination (as a whole
    saved shard loaded into part of a larger tensor is): then the saved bytes are that run's bytes."""
    tensor, region = op.piece.tensor, op.region
    if region.numel != span or not (tensor.is_cpu and tensor.is_contiguous()):
        return None
    first, end = contiguous_span(region.relative_to(op.piece.box), op.piece.box.lengths)
    if end - first != region.numel:
        return None
    itemsize = tensor.element_size()
    return byte_view(tensor)[first * itemsize: end * itemsize]


def _is_whole_copy(op: ReadOp) -> bool:
    """Whether the op reads a whole saved shard into the whole of a destination holding exactly its
    bytes (as when loading into the saved layout)."""
    tensor, nbytes = op.piece.tensor, op.shard.bytes.nbytes
    return (op.region == op.piece.box == op.shard.box and tensor.is_cpu and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() == nbytes)


def _wanted_in(inner: Box, lengths: tuple[int, ...], start: int, end: int, span: tuple[int, int]) -> list[Box]:
    """The boxes of ``inner`` (shard coordinates) whose elements lie in the shard's row-major
    elements ``[start, end)``; ``span`` is the range ``inner`` spans."""
    if start <= span[0] and span[1] <= end:
        return [inner]
    return [box for cut, _ in flat_range_to_boxes(lengths, start, end - start)
            if (box := cut.intersect(inner)) is not None]


def _merged(runs: list[_Run]) -> list[_Run]:
    """Runs that lie back to back in one stored range joined into one."""
    out: list[_Run] = []
    for run in sorted(runs, key=lambda r: (r.where.file, r.where.offset, r.low)):
        last = out[-1] if out else None
        # a stored range is named by where it lies (each op carries its own copy of the entry)
        if last is not None and (last.where.file, last.where.offset) == (run.where.file, run.where.offset) \
                and last.high == run.low:
            last.high = run.high
            last.dests += run.dests
            last.ops += run.ops
        else:
            out.append(run)
    return out


def _copy_bytes(dests: list[memoryview], skip: int, scratch: torch.Tensor) -> None:
    """Copy the scratch bytes from ``skip`` on into ``dests``, one after another."""
    source, at = byte_view(scratch), skip
    for dest in dests:
        dest[:] = source[at: at + dest.nbytes]
        at += dest.nbytes


def _copy_out(piece: Piece, shard: Box, boxes: list[Box], first_element: int, scratch: torch.Tensor) -> None:
    """Copy ``boxes`` (shard coordinates) into the piece from ``scratch``, which holds the shard's
    row-major elements from ``first_element`` on."""
    values = scratch.view(piece.tensor.dtype)
    strides = row_major_strides(shard.lengths)
    for box in boxes:
        at = values.storage_offset() + sum(o * s for o, s in zip(box.offsets, strides)) - first_element
        source = values.as_strided(box.lengths, strides, at)
        target = Box(tuple(o + s - p for o, s, p in zip(box.offsets, shard.offsets, piece.box.offsets)), box.lengths)
        piece.tensor[target.slices()].copy_(source)


def _batches(segments: list[_Segment]) -> list[list[_Segment]]:
    """Segments in file order; those back to back in one file grouped, up to ``READ_PART_BYTES``
    and ``BATCH_SEGMENTS`` per group, into one vectored read each."""
    batches: list[list[_Segment]] = []
    end, size = None, 0
    for segment in sorted(segments, key=lambda s: s.position):
        file, offset = segment.position
        if (file, offset) == end and size + segment.nbytes <= READ_PART_BYTES and len(batches[-1]) < BATCH_SEGMENTS:
            batches[-1].append(segment)
            size += segment.nbytes
        else:
            batches.append([segment])
            size = segment.nbytes
        end = (file, offset + segment.nbytes)
    return batches
