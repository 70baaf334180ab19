"""Physical read planning: how read ops become segments of stored bytes and batches of reads.

Read ops whose saved bytes are contiguous runs of their destinations become *runs*; runs back to
back in one stored range (the boxes of a flat FSDP/ZeRO shard) are merged into one, so they are read
as one stretch of the file into several buffers. A run is read straight into the destinations in
parts of at most ``READ_PART_BYTES``; when verifying, the partly wanted checksum chunks at its two
ends go through scratch memory, read whole. Other ops (a strided region of a shard) are read
through scratch in whole chunks of ``SCRATCH_PART_BYTES`` and their wanted elements copied out.
"Scratch" is the storage's own buffers where it hands them out (a mapping of a local file, an
object store's fetched bytes), else per-thread memory the bytes are read into.
Segments that lie back to back in one file (small tensors are stored so) are batched into one
vectored read.

A shard stored in compressed chunks (format version 4) is read in *coded* segments: the stored bytes
of the consecutive chunks that hold wanted bytes, and nothing else, decoded straight into the
destinations where the chunks are wholly wanted there, else into scratch out of which the wanted
bytes are copied.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from bcp.engine.bytes_of import byte_view
from bcp.errors import CorruptCheckpointError
from bcp.layout.box import Box, contiguous_span, flat_range_to_boxes, row_major_strides
from bcp.layout.dtypes import plane_width
from bcp.layout.manifest import ByteRange
from bcp.layout.piece import Piece
from bcp.layout.read_op import ReadOp

# Parts of a direct read (rounded to whole checksum chunks when verifying): large enough to
# stream, small enough to spread a large shard over the threads. Each part is verified right after
# it is read, mostly from the last-level cache; reading and verifying one chunk at a time was
# measured no faster (105 MiB L3) and a little slower without verification.
READ_PART_BYTES = 64 << 20
# Parts and batches of compressed chunks, in raw and in stored bytes: one batch is decoded on one
# thread, so batches of READ_PART_BYTES left the chunks of a state of a few files decoded on one or
# two of the reader's threads while the others waited (a 48 MB state in one file: one batch, every
# chunk decoded on one thread). An object store's GET is about this size (S3Storage's part) anyway.
CODED_PART_BYTES = 16 << 20
# Parts of a read through scratch memory (whole chunks, trimmed to those holding wanted bytes), so
# each worker's scratch stays small and the wanted elements are copied out while still in cache.
SCRATCH_PART_BYTES = 4 << 20
# At most this many segments per vectored read (Linux's IOV_MAX).
BATCH_SEGMENTS = 1024


@dataclass(slots=True)
class Progress:
    """The read ops a group of segments fills, and how many of those segments are not yet in place."""

    ops: list[ReadOp]
    left: int


@dataclass(slots=True)
class Coded:
    """Compressed chunks ``[first, end)`` of a stored range, whose raw bytes are ``[raw_start,
    raw_start + raw_nbytes)`` of it, coded in byte planes of ``width`` bytes where their codec says;
    decoded into ``dests`` (one after another), or, where None, into scratch for ``place``."""

    first: int
    end: int
    raw_start: int
    raw_nbytes: int
    width: int
    dests: list[memoryview] | None


@dataclass(slots=True)
class Segment:
    """Bytes ``[start, start + nbytes)`` of a stored range, read into ``dests`` one after another,
    or, when ``dests`` is None, into scratch memory out of which ``place`` copies the wanted bytes.
    For ``coded`` chunks, ``start`` and ``nbytes`` are the stored bytes', and ``place`` copies out
    of their decoded bytes."""

    where: ByteRange
    start: int
    nbytes: int
    dests: list[memoryview] | None
    place: Callable[[torch.Tensor], None] | None
    progress: Progress
    coded: Coded | None = None

    @property
    def position(self) -> tuple[int, int]:
        """Where the segment lies: (file index, byte offset in the file)."""
        return self.where.file, self.where.offset + self.start

    @property
    def key(self) -> str:
        """The tensor whose bytes these are, for errors."""
        return self.progress.ops[0].piece.name


@dataclass(slots=True)
class Run:
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


class SegmentPlanner:
    """Turns read ops into segments for stored ranges of ``files`` checksummed in ``chunk``-byte
    chunks (whole chunks are read where ``verify``); ``display`` names the checkpoint in errors."""

    def __init__(self, files: list[str], chunk: int, verify: bool, display: str) -> None:
        self.files = files
        self.chunk = chunk
        self.verify = verify
        self.display = display

    def segments(self, ops: list[ReadOp]) -> list[Segment]:
        """How to execute the reads: runs straight into destination memory (merged where back to
        back in a stored range), strided regions through scratch."""
        segments: list[Segment] = []
        runs: list[Run] = []
        for op in ops:
            shard, piece = op.shard, op.piece
            if shard.bytes.stored is None and shard.bytes.nbytes <= READ_PART_BYTES and _is_whole_copy(op):
                # the common case, kept cheap
                view = byte_view(piece.tensor)
                segments.append(Segment(shard.bytes, 0, view.nbytes, [view], None, Progress([op], 1)))
                continue
            itemsize = piece.tensor.element_size()
            inner, first, end = _in_shard(op, itemsize)
            if end * itemsize > shard.bytes.nbytes:
                raise CorruptCheckpointError(
                    f"read beyond the stored range in {self.files[shard.bytes.file]}",
                    path=self.display, key=piece.name)
            destination = _direct_destination(op, end - first)
            if destination is None:
                segments += self._strided_segments(op, inner, first, end)
            else:
                runs.append(Run(shard.bytes, first * itemsize, end * itemsize, [destination], [op]))
        for run in _merged(runs):
            segments += self._run_segments(run)
        return segments

    def _segment(self, where: ByteRange, low: int, high: int, dtype: torch.dtype, dests: list[memoryview] | None,
                 place: Callable[[torch.Tensor], None] | None, progress: Progress) -> Segment:
        """The segment of raw bytes ``[low, high)`` of ``where``, read into ``dests`` or for ``place``:
        those bytes as stored or, where the range's chunks are compressed, the stored bytes of the
        chunks holding them (``low`` chunk-aligned, ``high`` too or the range's end), decoded."""
        if where.stored is None:
            return Segment(where, low, high - low, dests, place, progress)
        first, end = low // self.chunk, -(-high // self.chunk)
        starts = where.stored.starts()
        return Segment(where, starts[first], starts[end] - starts[first], None, place, progress,
                       Coded(first, end, low, high - low, plane_width(dtype), dests))

    def _run_segments(self, run: Run) -> list[Segment]:
        """A run in parts straight into its destinations. When verifying, a direct part starts and
        ends on checksum chunks (or the end of the stored range): a partly wanted chunk at either
        end of the run is read whole into scratch and its wanted bytes copied out. Compressed chunks
        are read whole in any case: wholly wanted ones decoded straight into the destinations, the
        others into scratch."""
        where, dtype = run.where, run.ops[0].piece.tensor.dtype
        coded = where.stored is not None
        align = self.chunk if coded else self._alignment(dtype.itemsize)
        direct_low = -(-run.low // align) * align
        direct_high = run.high if run.high == where.nbytes else run.high // align * align
        progress = Progress(run.ops, 0)
        segments: list[Segment] = []
        through_scratch = [(run.low, run.high)]
        if direct_low < direct_high:
            step = _multiple(CODED_PART_BYTES if coded else READ_PART_BYTES, align)
            for at in range(direct_low, direct_high, step):
                part_end = min(at + step, direct_high)
                segments.append(self._segment(where, at, part_end, dtype, run.dests_for(at, part_end), None, progress))
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
                segments.append(self._segment(where, at, part_end, dtype, None, place, progress))
        progress.left = len(segments)
        return segments

    def _strided_segments(self, op: ReadOp, inner: Box, first: int, end: int) -> list[Segment]:
        """A region whose saved bytes are not one run of its destination: the stored elements
        ``[first, end)`` it spans, in whole chunks through scratch (of a compressed range, decoded
        there), each part copying the region's elements it holds into place (a part holding none is
        not read)."""
        shard, itemsize = op.shard, op.piece.tensor.element_size()
        coded = shard.bytes.stored is not None
        # a compressed chunk is read whole, and decoded parts hold whole elements
        align = math.lcm(self.chunk, itemsize) if coded else self._alignment(itemsize)
        start_byte, end_byte = _widened(first * itemsize, end * itemsize, align, shard.bytes.nbytes)
        progress = Progress([op], 0)
        segments, step = [], _multiple(SCRATCH_PART_BYTES, align)
        for at in range(start_byte, end_byte, step):
            part_end = min(at + step, end_byte)
            boxes = _wanted_in(inner, shard.box.lengths, at // itemsize, part_end // itemsize, (first, end))
            if boxes:  # the part, trimmed to the chunks its wanted elements lie in
                spans = [contiguous_span(box, shard.box.lengths) for box in boxes]
                low, high = _widened(min(lo for lo, _ in spans) * itemsize, max(hi for _, hi in spans) * itemsize,
                                     align, part_end)
                place = partial(_copy_out, op.piece, shard.box, boxes, low // itemsize)
                segments.append(self._segment(shard.bytes, low, high, op.piece.tensor.dtype, None, place, progress))
        progress.left = len(segments)
        return segments

    def _alignment(self, itemsize: int) -> int:
        """What segment boundaries are multiples of (within a stored range): whole elements, and
        whole checksum chunks when verifying, since a chunk's crc covers all of it."""
        return math.lcm(self.chunk, itemsize) if self.verify else itemsize


def batches_of(segments: list[Segment]) -> list[list[Segment]]:
    """Segments in file order; those back to back in one file grouped, up to ``READ_PART_BYTES``
    (``CODED_PART_BYTES`` of compressed chunks) and ``BATCH_SEGMENTS`` per group, into one vectored
    read each."""
    batches: list[list[Segment]] = []
    end, size = None, 0
    for segment in sorted(segments, key=lambda s: s.position):
        file, offset = segment.position
        limit = READ_PART_BYTES if segment.coded is None else CODED_PART_BYTES
        if (file, offset) == end and size + segment.nbytes <= limit and len(batches[-1]) < BATCH_SEGMENTS:
            batches[-1].append(segment)
            size += segment.nbytes
        else:
            batches.append([segment])
            size = segment.nbytes
        end = (file, offset + segment.nbytes)
    return batches


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


def _merged(runs: list[Run]) -> list[Run]:
    """Runs that lie back to back in one stored range joined into one."""
    out: list[Run] = []
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
