"""What the training process and its writer process say to each other (``writer_process``,
``writer_process_main``): a job (the data files to write, each a list of items) and its reply (done,
with every item's chunk checksums; or failed, with why), plus the two requests that stop it. Each
is a record (``wire_records``) sent as msgpack by ``process_wire``.

Light imports only: the writer process starts with this module alone."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union

from bcp.wire_records import WireRecord, kinds, list_of


@dataclass(frozen=True, slots=True)
class Padding(WireRecord):
    """Zero bytes before a piece placed for direct I/O (not checksummed)."""

    KIND = "padding"
    nbytes: int


@dataclass(frozen=True, slots=True)
class StagedPiece(WireRecord):
    """A piece staged in a shared buffer: ``nbytes`` at ``offset`` of buffer ``buffer``, with its
    chunk checksums where the training process knows them (None: the writer computes them);
    ``codec`` (``chunk_codecs``; RAW: written as it is) and the ``width`` of its byte planes say how
    its chunks are compressed."""

    KIND = "piece"
    buffer: int
    offset: int
    nbytes: int
    crcs: list[int] | None = None
    codec: int = 0
    width: int = 1


@dataclass(frozen=True, slots=True)
class ValueBytes(WireRecord):
    """A value record's bytes, with its chunk checksums where known."""

    KIND = "value"
    data: bytes
    crcs: list[int] | None = None


#: One item of a data file, written in order.
FileItem = Union[Padding, StagedPiece, ValueBytes]


@dataclass(frozen=True, slots=True)
class FileJob(WireRecord):
    """One data file: its storage name and its items in order."""

    NESTED = {"items": list_of(kinds(Padding, StagedPiece, ValueBytes))}
    name: str
    items: list[FileItem]


@dataclass(frozen=True, slots=True)
class SharedBuffer(WireRecord):
    """A shared buffer the writer process maps (its descriptor travels with the job)."""

    id: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class WriteJob(WireRecord):
    """Write ``files`` (one thread each) to the storage ``storage`` (pickled ``bcp.storage`` object:
    only bcp's own storage classes are sent, ``writer_process.storage_for_process``); ``new``
    buffers come with their descriptors, ``live`` are the ids of every buffer still held (the
    writer process unmaps the others); ``direct``: through the storage's direct I/O where it has it."""

    KIND = "write"
    NESTED = {"files": list_of(FileJob.from_wire), "new": list_of(SharedBuffer.from_wire)}
    storage: bytes
    chunk: int
    direct: bool
    files: list[FileJob]
    live: list[int] = field(default_factory=list)
    new: list[SharedBuffer] = field(default_factory=list)
    #: The zstd level of the pieces whose ``codec`` compresses.
    level: int = 1


@dataclass(frozen=True, slots=True)
class Abandon(WireRecord):
    """Stop the current job before its next piece (the save was abandoned)."""

    KIND = "abandon"


@dataclass(frozen=True, slots=True)
class Stop(WireRecord):
    """End the writer process."""

    KIND = "stop"


class Failure(enum.Enum):
    """Why a job failed: the save was abandoned, the storage refused, or anything else."""

    ABANDONED = "abandoned"
    STORAGE = "storage"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class ItemChunks(WireRecord):
    """How a compressed item's chunks were stored: each one's codec, stored length and the crc32c
    of its stored bytes."""

    codecs: list[int]
    nbytes: list[int]
    crcs: list[int]


def _per_file_items(wire: list[list[dict | None]]) -> list[list[ItemChunks | None]]:
    return [[None if item is None else ItemChunks.from_wire(item) for item in items] for items in wire]


@dataclass(frozen=True, slots=True)
class Done(WireRecord):
    """The job's files are written: each file's items' chunk checksums, in order (padding has none),
    and, where the job compressed, each item's stored chunks (None for an item written as it is)."""

    KIND = "done"
    NESTED = {"stored": _per_file_items}
    crcs: list[list[list[int]]]
    stored: list[list[ItemChunks | None]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Failed(WireRecord):
    """The job failed: why, and the message (a traceback for ``Failure.ERROR``)."""

    KIND = "failed"
    NESTED = {"reason": Failure}
    reason: Failure
    message: str


Request = Union[WriteJob, Abandon, Stop]
Reply = Union[Done, Failed]
#: The decoders of what each side receives.
read_request = kinds(WriteJob, Abandon, Stop)
read_reply = kinds(Done, Failed)
