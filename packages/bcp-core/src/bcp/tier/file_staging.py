"""A memory tier's asynchronous save staged in place: each rank's pieces are copied straight into
its data file of the new generation (one file per rank, in the node's folder), mapped shared, so
node memory holds the saved bytes once (no staging buffer written again into a file). The file is
one of the process's staging files (``engine.staging_files``), kept mapped from save to save, so
the copy finds its pages in place.

The background write then appends the value records, computes every piece's chunk checksums from
the mapped bytes, and makes the file durable; replication and persistence read the file, and the
commit marker comes last as for any tier save (``tier.commit``). A save that fails leaves the
committed generation as it was: its own generation is discarded, which unlinks the file from it
and frees it for a later save."""

from __future__ import annotations

import os
import threading
from typing import Callable, Sequence

import torch

from bcp.api.runtime import Runtime
from bcp.engine.bytes_of import byte_view
from bcp.engine.checksum import chunk_crcs, joined_chunk_crcs
from bcp.engine.location import Location, data_file_name
from bcp.engine.shared_memory import MappedFile
from bcp.engine.writer import GenerationWriter
from bcp.errors import SaveAbandonedError, StorageError
from bcp.layout.write_plan import PieceWrite, ValueWrite
from bcp.layout.write_report import PieceRecord, RankWrites, ValueRecord, WrittenPieces

#: The folder of a node's folder that holds its processes' staging files.
STAGING_DIR = "staging"


class InGenerationFiles:
    """The staging of one rank's asynchronous tier save (``api.save.Staging``): a staging file of
    the process, linked as the rank's data file of ``generation``; it holds one of the pool's places
    (so at most ``max_sets`` saves are staged at once) until the save's writes are done."""

    def __init__(self, rt: Runtime, location: Location, generation: int, rank: int) -> None:
        self.rt, self.location, self.generation, self.rank = rt, location, generation, rank
        self.file: MappedFile | None = None

    def acquire(self, nbytes: int) -> torch.Tensor:
        pool = self.rt.buffers
        pool.hold_place()
        try:
            root = self.location.storage.root
            path = os.path.join(root, *self.location.name(self.generation, data_file_name(self.rank, 0)).split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            folder = os.path.join(root, self.location.prefix, STAGING_DIR)
            self.file = pool.files.take(folder, self.rank, nbytes, path, limit=pool.max_sets + 1)
            if self.file is None:  # each file holds a generation: the committed one, and saves not committed yet
                self.rt.background.wait_pending()  # their commits retire generations, which frees files
                self.file = pool.files.take(folder, self.rank, nbytes, path)
        except OSError as exc:
            pool.free_place()
            raise StorageError(f"cannot stage generation {self.generation} in the node's folder: "
                               f"{exc.strerror or exc}", path=self.location.display) from exc
        except BaseException:
            pool.free_place()
            raise
        return self.file.tensor[:nbytes]

    def release(self, buffer: torch.Tensor, *, copied_from: torch.device | None = None) -> None:
        self.rt.buffers.files.give_back(self.file)
        self.rt.buffers.free_place()

    def writer(self, buffer: torch.Tensor, abandon: threading.Event) -> GenerationWriter:
        return StagedFileWriter(self.location, self.generation, self.file, buffer.numel(), abandon)


class StagedFileWriter(GenerationWriter):
    """The writer of a generation whose pieces are staged in the rank's data file itself: the first
    ``staged_nbytes`` of ``file``. It writes the value records after them."""

    def __init__(self, location: Location, generation: int, file: MappedFile, staged_nbytes: int,
                 abandon: threading.Event) -> None:
        super().__init__(location, generation, threads=1, background=True, abandon=abandon)
        self.file = file
        self.staged_nbytes = staged_nbytes

    def write_rank(self, rank: int, pieces: Sequence[PieceWrite], values: Sequence[ValueWrite],
                   on_written: Callable[[int], None] | None = None) -> RankWrites:
        base = self.file.tensor.data_ptr()
        piece_rows = []
        for piece in pieces:
            self._check_abandoned()
            view = byte_view(piece.tensor())
            piece_rows.append(PieceRecord.of(piece, 0, piece.tensor().data_ptr() - base, piece.nbytes,
                                             chunk_crcs(view, self.chunk)))
        if on_written is not None:
            on_written(sum(piece.nbytes for piece in pieces))
        value_rows, offset = [], self.staged_nbytes
        try:
            for value in values:
                value_rows.append(ValueRecord(value.name, 0, offset, value.nbytes, value.tree_nbytes,
                                              joined_chunk_crcs(value.parts, self.chunk),
                                              list(value.ranks) if value.ranks else None))
                for part in value.parts:
                    offset = _write_at(self.file.fd, memoryview(part).cast("B"), offset)
            os.fsync(self.file.fd)
        except OSError as exc:
            os.ftruncate(self.file.fd, self.staged_nbytes)  # what was written of the values: a full tmpfs gets it back
            raise StorageError(f"writing the values of rank {rank} failed: {exc.strerror or exc}",
                               path=self.location.display) from exc
        self._check_abandoned()
        return RankWrites([data_file_name(rank, 0)], WrittenPieces.of(piece_rows), value_rows,
                          any(v.used_pickle for v in values), any(v.refs for v in values))

    def _check_abandoned(self) -> None:
        if self.abandon is not None and self.abandon.is_set():
            raise SaveAbandonedError(f"the save of generation {self.generation} was abandoned before its files "
                                     "were complete", path=self.location.display)


def _write_at(fd: int, data: memoryview, offset: int) -> int:
    """Write all of ``data`` at ``offset``; returns the offset after it."""
    while data.nbytes:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written
    return offset
