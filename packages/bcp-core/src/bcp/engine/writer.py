"""Writing one generation of a checkpoint: every rank writes its pieces and value records into data
files, with chunk checksums, several files in parallel (one writer thread per file), straight from
tensor memory; then the coordinating rank commits the manifest (``Location.commit``).

An asynchronous save may hand the file writes to the writer process (``writer_process``): its
pieces are then staged in shared memory, and the writer process writes and checksums them while
this process only waits for its answer. Each large piece then lies in its file at the same place
modulo a page as in the shared buffer, so that the disk can read it straight from there (direct I/O).

Pieces in accelerator memory are written through a few pinned host chunks (``chunked_copies``):
the device copy of the next chunks runs while the writer thread checksums and writes the current
one, so host memory holds a few chunks per thread, not the pieces.

Pieces may be produced lazily (the tools that stream one checkpoint into another): each writer
thread asks for one piece's tensor when it reaches it and releases it right after, so memory holds
about one piece per thread however large the checkpoint is.

With ``compression``, the writer threads (or the writer process) code each piece's checksum chunks
as they write them (``chunk_coding``); a piece's place in its file then follows the stored lengths
of the pieces before it, known only once they are written.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Sequence

import torch

from bcp.chunk_codecs import RAW, Compression, codec_for
from bcp.engine.checksum import chunk_crcs, joined_chunk_crcs
from bcp.engine.chunk_coding import ItemCoder
from bcp.engine.chunked_copies import ChunkedCopies, Source
from bcp.engine.location import Location, data_file_name
from bcp.engine.priority import lower_this_thread
from bcp.engine.shared_memory import SharedHostBuffer
from bcp.engine.writer_jobs import FileItem, FileJob, ItemChunks, Padding, StagedPiece, ValueBytes
from bcp.engine import writer_process
from bcp.errors import CheckpointError, SaveAbandonedError, StorageError
from bcp.storage.base import streamed_from
from bcp.storage.local import DIRECT_ALIGN, DIRECT_MIN_BYTES
from bcp.layout.dtypes import exponent_bits, plane_width
from bcp.layout.manifest import DEFAULT_CHECKSUM_CHUNK, Manifest
from bcp.layout.shard_table import StoredChunks
from bcp.layout.write_plan import PieceWrite, ValueWrite
from bcp.layout.write_report import PieceRecord, RankWrites, ValueRecord, WrittenPieces

# Below this many bytes per file, another file (and writer thread) costs more than it saves.
MIN_BYTES_PER_FILE = 32 << 20


@dataclass(slots=True)
class _Item:
    nbytes: int
    piece: PieceWrite | None = None
    value: ValueWrite | None = None
    #: Where the piece lies in the shared buffer, when the writer process writes it.
    staged: int | None = None


@dataclass(slots=True)
class _Written:
    """An item as written: its raw chunk checksums, and its stored chunks where it was compressed."""

    crcs: list[int]
    stored: StoredChunks | None = None

    @property
    def stored_nbytes(self) -> int | None:
        return None if self.stored is None else sum(self.stored.nbytes)


@dataclass(frozen=True, slots=True)
class InProcess:
    """Writes handed to the writer process: ``storage`` pickled for it, the shared ``buffer`` the
    pieces are staged in, and the ids of every shared buffer the training process still holds."""

    process: writer_process.WriterProcess
    storage: bytes
    buffer: SharedHostBuffer
    live: set[int]


class GenerationWriter:
    """Generation ``generation`` at ``location``, being written."""

    def __init__(self, location: Location, generation: int, *, threads: int,
                 chunk: int = DEFAULT_CHECKSUM_CHUNK, background: bool = False,
                 abandon: threading.Event | None = None, in_process: InProcess | None = None,
                 copies: ChunkedCopies | None = None, compression: Compression | None = None) -> None:
        self.location = location
        self.generation = generation
        self.threads = threads
        self.chunk = chunk
        #: Writer threads at a lower CPU and I/O priority (an asynchronous save, beside training).
        self.background = background
        #: Once set, the writes stop before their next piece and fail with SaveAbandonedError (set
        #: after the last piece, ``write_rank`` fails all the same: the save does not commit).
        self.abandon = abandon
        #: Where set, the writer process writes the files (from the staged shared buffer).
        self.in_process = in_process
        #: How pieces in accelerator memory reach the host (made where the pieces were produced).
        self.copies = copies if copies is not None else ChunkedCopies.for_host()
        #: Where set, every piece's chunks are compressed (a chunk that does not shrink stays raw).
        self.compression = compression

    def write_rank(self, rank: int, pieces: Sequence[PieceWrite], values: Sequence[ValueWrite],
                   on_written: Callable[[int], None] | None = None) -> RankWrites:
        """Write this rank's data files and report where everything lies; ``on_written(nbytes)``
        after each piece, or each chunk of a piece in accelerator memory (from a writer thread)."""
        items = [_Item(p.nbytes, piece=p) for p in pieces] + [_Item(v.nbytes, value=v) for v in values]
        total = sum(item.nbytes for item in items)
        threads = self.threads if self.in_process is None else min(self.threads, writer_process.FILES_AT_ONCE)
        bins = _balance(items, max(1, min(threads, len(items), total // MIN_BYTES_PER_FILE)))
        files = [data_file_name(rank, i) for i in range(len(bins))]
        if self.in_process is not None:
            for item in items:
                if item.piece is not None:
                    item.staged = _staged_offset(item.piece, self.in_process.buffer)
        # compressed pieces are not where they were staged: no place kept for direct I/O
        placed = [_placed(file_items, aligned=self.compression is None) for file_items in bins]
        if self.in_process is not None:
            written = self._write_in_process(files, placed)
            if on_written is not None:
                on_written(sum(item.nbytes for item in items if item.piece is not None))
        else:
            written = self._write_in_threads(files, bins, on_written)
        if self.abandon is not None and self.abandon.is_set():  # after the last piece, still before the commit
            raise SaveAbandonedError(f"the save of generation {self.generation} was abandoned after its files "
                                     "were written, before its commit", path=self.location.display)
        piece_rows: list[PieceRecord] = []
        value_rows: list[ValueRecord] = []
        for file_index, (file_items, file_written) in enumerate(zip(placed, written)):
            for (item, _), item_written, offset in zip(file_items, file_written, _offsets(file_items, file_written)):
                if item.piece is not None:
                    piece_rows.append(PieceRecord.of(item.piece, file_index, offset, item.nbytes, item_written.crcs,
                                                     item_written.stored))
                else:
                    value = item.value
                    value_rows.append(ValueRecord(value.name, file_index, offset, item.nbytes, value.tree_nbytes,
                                                  item_written.crcs, list(value.ranks) if value.ranks else None))
        return RankWrites(files, WrittenPieces.of(piece_rows), value_rows, any(v.used_pickle for v in values),
                          any(v.refs for v in values))

    def _write_in_threads(self, files: list[str], bins: list[list[_Item]],
                          on_written: Callable[[int], None] | None) -> list[list[_Written]]:
        if on_written is not None:  # called from the writer threads: one at a time
            on_written = _serialized(on_written)
        with ThreadPoolExecutor(max_workers=len(bins) or 1, thread_name_prefix="bcp-write",
                                initializer=lower_this_thread if self.background else None) as pool:
            futures = [pool.submit(self._write_file, files[i], file_items, on_written)
                       for i, file_items in enumerate(bins)]
            return [future.result() for future in futures]

    def _write_in_process(self, files: list[str], placed: list[list[tuple[_Item, int]]]) -> list[list[_Written]]:
        """Each file as the writer process writes it, in order: zero bytes before a piece placed for
        direct I/O, a piece's place in the shared buffer (and how to compress it), a value's bytes."""
        to = self.in_process
        jobs = []
        for name, file_items in zip(files, placed):
            listed: list[FileItem] = []
            end = 0
            for item, offset in file_items:
                if offset > end:
                    listed.append(Padding(offset - end))
                listed.append(StagedPiece(to.buffer.id, item.staged, item.nbytes, self._known_crcs(item),
                                          *self._codec_of(item.piece))
                              if item.piece is not None else ValueBytes(item.value.joined(), self._known_crcs(item)))
                end = offset + item.nbytes
            jobs.append(FileJob(self.location.name(self.generation, name), listed))
        done = to.process.write_files(to.storage, self.chunk, jobs, [to.buffer], to.live, self.abandon,
                                      f"writing generation {self.generation}", self.location.display,
                                      self.compression.level if self.compression is not None else 1)
        stored = done.stored or [[None] * len(file_crcs) for file_crcs in done.crcs]
        return [[_Written(crcs, _stored_chunks(chunks)) for crcs, chunks in zip(file_crcs, file_stored)]
                for file_crcs, file_stored in zip(done.crcs, stored)]

    def _codec_of(self, piece: PieceWrite) -> tuple[int, int]:
        """How a piece's chunks are compressed: codec id and plane width (``RAW``: not at all)."""
        if self.compression is None:
            return RAW, 1
        dtype = piece.dtype if piece.dtype is not None or callable(piece.data) else piece.data.dtype
        if dtype is None:
            return codec_for(1), 1
        width = plane_width(dtype)
        return codec_for(width, exponent_bits(dtype)), width

    def _known_crcs(self, item: _Item) -> list[int] | None:
        """The item's chunk checksums where the save computed them already (at this chunk size)."""
        known = item.piece.crcs if item.piece is not None else item.value.crcs
        return list(known) if known is not None and self.chunk == DEFAULT_CHECKSUM_CHUNK else None

    def commit(self, manifest: Manifest) -> int | None:
        """Make the generation visible (shard table, manifest, then the commit marker), then remove
        the generations retention no longer keeps; returns the oldest generation kept."""
        self.location.commit(self.generation, manifest)
        return self.location.apply_retention(self.generation, manifest.earlier_generations())

    def discard(self, every_writer_stopped: bool = False) -> None:
        """Remove what was written of this generation (never a committed one), best effort; the
        generation goes whole where every rank's writes have ended (``Location.discard``)."""
        self.location.discard(self.generation, every_writer_stopped)

    def _write_file(self, name: str, items: list[_Item], on_written: Callable[[int], None] | None) -> list[_Written]:
        """Write one data file; each item's chunk checksums and stored chunks, in order."""
        crcs: list[list[int]] = []
        coders: list[ItemCoder | None] = []
        chunk = self.chunk

        reused_from = streamed_from(self.location.storage)
        computing = False  # whether the current item's checksums are computed from its views

        def stream() -> Iterator[memoryview]:
            nonlocal computing
            views = self.copies.write_views([_source(item) for item in items], multiple_of=chunk,
                                            reused_from=reused_from)
            with closing(views):
                for index, data in views:
                    if self.abandon is not None and self.abandon.is_set():
                        raise SaveAbandonedError(f"the save of generation {self.generation} was abandoned "
                                                 f"before {name} was complete", path=self.location.display)
                    item = items[index]
                    if index == len(crcs):  # the item's first view
                        known = self._known_crcs(item)
                        if known is None and item.value is not None:
                            known = joined_chunk_crcs(item.value.parts, chunk)
                        computing = known is None
                        crcs.append([] if computing else known)
                        coders.append(self._coder(item, reused_from))
                    if computing:  # a piece's views are whole checksum chunks but the last
                        crcs[index].extend(chunk_crcs(data, chunk))
                    if coders[index] is not None:
                        yield from coders[index].code(data, crcs[index])
                    else:
                        yield data
                    if on_written is not None and item.piece is not None:
                        on_written(data.nbytes)
                    del data  # a produced piece is released before the next one is made

        views = stream()
        try:
            self.location.storage.write_file(self.location.name(self.generation, name), views)
        except OSError as exc:
            raise StorageError(f"writing {name} failed: {exc}", path=self.location.display) from exc
        finally:  # now, not when the error's traceback lets go of it: its chunks go back to the pool
            views.close()
        return [_Written(item_crcs, None if coder is None else StoredChunks(tuple(coder.codecs), tuple(coder.nbytes),
                                                                            tuple(coder.crcs)))
                for item_crcs, coder in zip(crcs, coders)]

    def _coder(self, item: _Item, reused_from: int | None) -> ItemCoder | None:
        """What compresses a piece's chunks as they are written (None: written as they are)."""
        if item.piece is None or self.compression is None:
            return None
        codec, width = self._codec_of(item.piece)
        return ItemCoder(codec, width, self.compression.level, self.chunk, reused_from)


def _stored_chunks(chunks: ItemChunks | None) -> StoredChunks | None:
    return None if chunks is None else StoredChunks(tuple(chunks.codecs), tuple(chunks.nbytes), tuple(chunks.crcs))


def _serialized(callback: Callable[[int], None]) -> Callable[[int], None]:
    lock = threading.Lock()

    def call(nbytes: int) -> None:
        with lock:
            callback(nbytes)
    return call


def _source(item: _Item) -> Source:
    """What an item writes: a value's parts, a piece's tensor (checked now), or a function that
    produces a streamed piece's tensor when the writer reaches it."""
    if item.piece is None:
        return tuple(map(memoryview, item.value.parts))
    return partial(_produced, item.piece) if callable(item.piece.data) else _produced(item.piece)


def _produced(write: PieceWrite) -> torch.Tensor:
    tensor = write.tensor()
    if tensor.numel() * tensor.element_size() != write.nbytes:
        raise CheckpointError(f"piece {write.index} produced {tensor.numel() * tensor.element_size()} bytes, "
                              f"{write.nbytes} were planned")
    return tensor


def _staged_offset(piece: PieceWrite, buffer: SharedHostBuffer) -> int:
    tensor = piece.tensor()
    offset = tensor.data_ptr() - buffer.tensor.data_ptr()
    if not 0 <= offset <= buffer.nbytes - piece.nbytes or not tensor.is_contiguous():
        raise CheckpointError(f"piece {piece.index} is not staged in the shared buffer")
    return offset


def _placed(items: list[_Item], aligned: bool) -> list[tuple[_Item, int]]:
    """Each item with its offset in its file: one after the other, except that (where ``aligned``) a
    staged piece large enough for direct I/O starts at the same place modulo ``DIRECT_ALIGN`` as its
    copy in shared memory (after fewer than ``DIRECT_ALIGN`` zero bytes), as direct I/O needs of
    memory and file alike. Small pieces stay back to back, for the batched reads of loads."""
    placed, offset = [], 0
    for item in items:
        if aligned and item.staged is not None and item.nbytes >= DIRECT_MIN_BYTES:
            offset += (item.staged - offset) % DIRECT_ALIGN
        placed.append((item, offset))
        offset += item.nbytes
    return placed


def _offsets(placed: list[tuple[_Item, int]], written: list[_Written]) -> list[int]:
    """Each item's offset in its file: as placed, or, where pieces were compressed, one after the
    other at their stored lengths."""
    if all(w.stored is None for w in written):
        return [offset for _, offset in placed]
    offsets, end = [], 0
    for (item, _), w in zip(placed, written):
        offsets.append(end)
        end += item.nbytes if w.stored is None else w.stored_nbytes
    return offsets


def _balance(items: list[_Item], nbins: int) -> list[list[_Item]]:
    """Largest first into the emptiest file, so the writer threads finish together. One file
    keeps the given order."""
    if nbins == 1:
        return [items] if items else []
    bins: list[list[_Item]] = [[] for _ in range(nbins)]
    sizes = [0] * nbins
    for item in sorted(items, key=lambda it: -it.nbytes):
        i = sizes.index(min(sizes))
        bins[i].append(item)
        sizes[i] += item.nbytes
    return [b for b in bins if b]
