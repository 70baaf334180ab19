"""The manifest: the one global metadata file that describes a committed checkpoint.

It is JSON (never pickle), columnar per tensor so that a million shard entries parse in a fraction
of a second, and every field is validated on read: a hostile manifest yields a
``CorruptCheckpointError``, never code execution. ``docs/format.md`` is the specification.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from crc32c import crc32c

from bcp.chunk_codecs import KNOWN, RAW, Compression
from bcp.errors import CorruptCheckpointError, FormatVersionError
from bcp.layout.dtypes import dtype_from_name, itemsize
from bcp.layout.references import copied_name, referred_generations, split_reference
from bcp.layout.shard_table import ByteRange, ChunkColumns, ShardEntry, ShardTable, raw_chunk_lengths

FORMAT_NAME = "bcp"
SHARD_TABLE = "shard_table.bin"
#: The newest format version. Version 2 adds references from value records to tensors saved beside
#: them (``layout.values``), version 3 data files of earlier generations (``layout.references``),
#: version 4 compressed chunks (``chunk_codecs``); a checkpoint is written in the oldest version
#: that holds what it uses (:func:`format_version`).
FORMAT_VERSION = 4
SUPPORTED_VERSIONS = (1, 2, 3, 4)
#: The first version whose manifests may list data files of earlier generations.
EARLIER_FILES_VERSION = 3
#: The first version whose shard tables hold the columns of compressed chunks.
COMPRESSED_VERSION = 4
#: The commit marker's own format has one version.
MARKER_VERSION = 1
CHECKSUM_ALGORITHM = "crc32c"
DEFAULT_CHECKSUM_CHUNK = 1 << 20
# Every integer of the format is an int64; sizes and element counts must fit one.
INT64_MAX = 2**63 - 1
# Bounds on what metadata may claim, so a small hostile manifest cannot cost much memory.
MAX_NDIM = 1024
MAX_CHECKSUM_CHUNK = 1 << 40


class TensorEntry:
    """A tensor of the checkpoint: dtype, global shape and its stored shards. Shards loaded from a
    checkpoint stay in the shard table until a caller first asks for them."""

    __slots__ = ("name", "dtype", "shape", "_shards", "_table", "_first", "_count")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], shards: list[ShardEntry] | None = None) -> None:
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)
        self._shards = shards if shards is not None else []
        self._table: ShardTable | None = None
        self._first = self._count = 0

    @staticmethod
    def from_table(name: str, dtype: str, shape: tuple[int, ...], table: ShardTable, first: int,
                   count: int) -> "TensorEntry":
        entry = TensorEntry(name, dtype, shape)
        entry._shards, entry._table, entry._first, entry._count = None, table, first, count
        return entry

    @property
    def shards(self) -> list[ShardEntry]:
        if self._shards is None:
            self._shards = self._table.rows(self._first, self._count, len(self.shape))
        return self._shards

    @property
    def component(self) -> str:
        return component_of(self.name)

    def table_rows(self, chunk: int) -> tuple[ShardTable, int, int]:
        """This tensor's shards as rows ``[first, first + count)`` of a table, for array operations:
        the checkpoint's table while they are untouched, else a table of the current list (checksums
        over ``chunk``-byte chunks)."""
        if self._shards is None:
            return self._table, self._first, self._count
        return ShardTable.from_entries([self._shards], len(self.shape), chunk), 0, len(self._shards)

    def _table_range(self) -> tuple[ShardTable, int, int] | None:
        return (self._table, self._first, self._count) if self._shards is None else None


@dataclass(slots=True)
class ObjectEntry:
    """A non-tensor value saved per rank. ``ranks[r]`` indexes ``records`` for rank ``r``, so ranks
    that saved identical bytes share one record. A record's first ``tree_nbytes`` bytes are the
    encoded value tree (JSON); tensor and byte blobs follow."""

    name: str
    records: list[tuple[ByteRange, int]]
    ranks: list[int]

    @property
    def component(self) -> str:
        return component_of(self.name)


def format_version(refs: bool, earlier_files: bool = False, compressed: bool = False) -> int:
    """The oldest version that holds what a checkpoint uses: 4 where a chunk is stored compressed,
    3 where it lists data files of earlier generations, 2 where a value record refers to tensors,
    else 1."""
    return COMPRESSED_VERSION if compressed else EARLIER_FILES_VERSION if earlier_files else 2 if refs else 1


@dataclass(slots=True)
class Manifest:
    generation: int
    world_size: int
    framework: str
    files: list[str]
    tensors: dict[str, TensorEntry]
    objects: dict[str, ObjectEntry]
    checksum_chunk: int = DEFAULT_CHECKSUM_CHUNK
    unsafe_pickle: bool = False
    created_unix: float = 0.0
    writer: str = ""
    version: int = 1
    #: The training step the save was taken at, where the caller said (``SaveOptions.step``).
    step: int | None = None
    #: The compression the save asked for (informational: the shard table says how each chunk lies).
    compression: Compression | None = None

    def holder_of(self, name: str) -> str | None:
        """The value whose record refers to entry ``name`` (saved as ``<value>/...``), if any."""
        head = name.rpartition("/")[0]
        while head:
            if head in self.objects:
                return head
            head = head.rpartition("/")[0]
        return None

    def earlier_generations(self) -> set[int]:
        """The earlier generations whose data files this generation's shards and records lie in."""
        return referred_generations(self.files)

    def copied_as(self, generation: int) -> "Manifest":
        """This manifest as generation ``generation`` of a checkpoint that holds a copy of every data
        file it lists, those of earlier generations under names of their own (``copied_name``)."""
        return dataclasses.replace(self, generation=generation, files=[copied_name(f) for f in self.files],
                                   version=format_version(self.version >= 2, compressed=self.version >= COMPRESSED_VERSION))

    def components(self) -> set[str]:
        return {e.component for e in self.tensors.values()} | {e.component for e in self.objects.values()}

    def total_tensor_bytes(self) -> int:
        return sum(s.bytes.nbytes for e in self.tensors.values() for s in e.shards)

    def encode(self) -> tuple[bytes, bytes]:
        """The manifest JSON and the shard table bytes (the JSON records the table's checksum)."""
        names = list(self.tensors)
        table, ranges = self._table(names)
        if (table.chunks is not None) != (self.version >= COMPRESSED_VERSION):
            if table.chunks is not None:
                raise ValueError(f"a manifest of format version {self.version} cannot hold compressed chunks")
            table = ShardTable(table.offsets, table.lengths, table.file, table.offset, table.nbytes, table.crc_first,
                               table.crcs, ChunkColumns.raw(table.nbytes, table.crc_first, table.crcs,
                                                            self.checksum_chunk))
        table_bytes = table.encode()
        doc = {
            "format": FORMAT_NAME,
            "version": self.version,
            "generation": self.generation,
            "world_size": self.world_size,
            "framework": self.framework,
            "created_unix": self.created_unix,
            "writer": self.writer,
            **({} if self.step is None else {"step": self.step}),
            **({} if self.compression is None else {"compression": self.compression.to_manifest()}),
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "chunk_bytes": self.checksum_chunk},
            "unsafe_pickle": self.unsafe_pickle,
            "files": self.files,
            "shard_table": {"name": SHARD_TABLE, "count": table.count, "ndim": table.ndim,
                            "nbytes": len(table_bytes), "crc32c": crc32c(table_bytes)},
            "tensors": {
                name: {"dtype": e.dtype, "shape": list(e.shape), "shards": list(ranges[name])}
                for name, e in self.tensors.items()
            },
            "objects": {
                name: {
                    "records": [[r.file, r.offset, r.nbytes, tree, list(r.crcs)] for r, tree in e.records],
                    "ranks": e.ranks,
                }
                for name, e in self.objects.items()
            },
        }
        return json.dumps(doc, separators=(",", ":")).encode(), table_bytes

    def _table(self, names: list[str]) -> tuple[ShardTable, dict[str, tuple[int, int]]]:
        """One table for all tensors: the shared table as it is when every entry is still an
        untouched, in-order range of it (a manifest assembled by the coordinator), else a new one."""
        ranges = [self.tensors[n]._table_range() for n in names]
        if ranges and all(r is not None and r[0] is ranges[0][0] for r in ranges):
            position, tiled = 0, True
            for _, first, count in ranges:
                tiled &= first == position
                position += count
            if tiled and position == ranges[0][0].count:
                return ranges[0][0], {n: (r[1], r[2]) for n, r in zip(names, ranges)}
        ndim = max((len(self.tensors[n].shape) for n in names), default=0)
        groups = [self.tensors[n].shards for n in names]
        starts = np.concatenate([[0], np.cumsum([len(g) for g in groups])]).tolist()
        return ShardTable.from_entries(groups, ndim, self.checksum_chunk), {n: (starts[i], len(groups[i])) for i, n in enumerate(names)}

    @staticmethod
    def decode(data: bytes, table: bytes, *, path: str | None = None) -> "Manifest":
        """Parse and validate a manifest and its shard table (as read from storage)."""
        return _ManifestParser(path).parse(data, table)


def component_of(name: str) -> str:
    return name.split("/", 1)[0]


class _ManifestParser:
    """Reads a manifest defensively: every field is type-checked before use, and the shard table
    is validated with array operations (millions of rows in well under a second)."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def fail(self, what: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"invalid manifest: {what}", path=self.path, key=key)

    def parse(self, data: bytes, table_bytes: bytes) -> Manifest:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise self.fail(f"not valid JSON ({exc})") from None
        except RecursionError:
            raise self.fail("JSON nested too deeply") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise self.fail("not a bcp manifest")
        version = doc.get("version")
        if type(version) is not int or version not in SUPPORTED_VERSIONS:
            raise FormatVersionError(
                f"format version {version!r} is not readable by this bcp (reads {SUPPORTED_VERSIONS}); "
                "upgrade bcp",
                path=self.path,
            )
        checksum = self.dict_of(doc, "checksum")
        if checksum.get("algorithm") != CHECKSUM_ALGORITHM:
            raise self.fail(f"unknown checksum algorithm {checksum.get('algorithm')!r}")
        generation = self.int_of(doc, "generation", minimum=0)
        files = self.files(doc.get("files"), version, generation)
        self.nfiles = len(files)
        self.chunk = self.int_of(checksum, "chunk_bytes", minimum=1, maximum=MAX_CHECKSUM_CHUNK)
        world_size = self.int_of(doc, "world_size", minimum=1)
        table = self.table(self.dict_of(doc, "shard_table"), table_bytes, version >= COMPRESSED_VERSION)
        return Manifest(
            version=version,
            generation=generation,
            world_size=world_size,
            framework=self.str_of(doc, "framework"),
            files=files,
            tensors=self.tensors(self.dict_of(doc, "tensors"), table),
            objects={n: self.object(n, e, world_size) for n, e in self.dict_of(doc, "objects").items()},
            checksum_chunk=self.chunk,
            unsafe_pickle=self.optional(doc, "unsafe_pickle", (bool,), False),
            created_unix=self.seconds_since_epoch(doc, "created_unix"),
            writer=self.optional(doc, "writer", (str,), ""),
            step=self.optional_step(doc),
            compression=self.compression(doc),
        )

    def files(self, files: Any, version: int, generation: int) -> list[str]:
        """Relative paths inside the generation's folder; from version 3 also files of an earlier
        generation of the same checkpoint (``gen-<8 digits>/<relative path>``, ``layout.references``).
        A name beginning ``gen-`` is nothing else: in earlier versions no bcp wrote one."""
        if not isinstance(files, list) or not all(isinstance(f, str) and _safe_relpath(f) for f in files):
            raise self.fail("'files' must be a list of relative paths inside the checkpoint")
        for name in files:
            if not name.startswith("gen-"):
                continue
            earlier = split_reference(name) if version >= EARLIER_FILES_VERSION else None
            if earlier is None or not 1 <= earlier[0] < generation or earlier[1].startswith("gen-"):
                raise self.fail(f"data file {name!r} is not a file of an earlier generation of this checkpoint "
                                f"(gen-<8 digits earlier than {generation}>/<name>, format version "
                                f"{EARLIER_FILES_VERSION} or later)")
        return files

    def table(self, spec: dict, data: bytes, chunk_columns: bool) -> ShardTable:
        count = self.int_of(spec, "count", minimum=0)
        ndim = self.int_of(spec, "ndim", minimum=0, maximum=MAX_NDIM)
        if spec.get("nbytes") != len(data) or spec.get("crc32c") != crc32c(data):
            raise self.fail("the shard table does not match its size and checksum in the manifest")
        try:
            table = ShardTable.decode(data, count, ndim, chunk_columns)
        except ValueError as exc:
            raise self.fail(str(exc)) from None
        first = table.crc_first
        if (first[0] != 0 or first[-1] != len(table.crcs) or np.any(np.diff(first) < 0)
                or np.any(table.file < 0) or np.any(table.file >= self.nfiles)
                or np.any(table.offset < 0) or np.any(table.nbytes < 0)
                or np.any(table.offset > INT64_MAX - table.nbytes)):
            raise self.fail("shard table rows hold out-of-range files, offsets or checksum indices")
        if np.any(np.diff(first) != np.maximum(1, -(-table.nbytes // self.chunk))):
            raise self.fail("a shard's checksum count does not match its size")
        if table.chunks is not None:
            self.stored_chunks(table)
        return table

    def stored_chunks(self, table: ShardTable) -> None:
        """The columns of compressed chunks: known codecs; a raw chunk stored as it is (its length
        and crc those of its raw bytes); a compressed one shorter than its raw bytes and not empty
        (a chunk that did not shrink is stored raw), so no stored length can claim more than the
        chunk holds; and each shard's chunks adding up to its stored length."""
        chunks = table.chunks
        raw_lengths = raw_chunk_lengths(table.nbytes, table.crc_first, self.chunk)
        raw = chunks.chunk_codec == RAW
        if not np.all(np.isin(chunks.chunk_codec, KNOWN)):
            unknown = int(chunks.chunk_codec[~np.isin(chunks.chunk_codec, KNOWN)][0])
            raise self.fail(f"a chunk's codec id {unknown} is not one this bcp knows (knows {list(KNOWN)}): "
                            "written by a newer bcp? Upgrade bcp to load it")
        if np.any(raw & ((chunks.chunk_stored != raw_lengths) | (chunks.stored_crcs != table.crcs))):
            raise self.fail("a raw chunk's stored length or checksum differs from its raw bytes'")
        if np.any(~raw & ((chunks.chunk_stored <= 0) | (chunks.chunk_stored >= raw_lengths))):
            raise self.fail("a compressed chunk's stored length is not between 1 and its raw length - 1")
        sums = np.add.reduceat(chunks.chunk_stored, table.crc_first[:-1]) if table.count else chunks.stored_nbytes
        if np.any(sums != chunks.stored_nbytes):
            raise self.fail("a shard's stored length is not the sum of its chunks' stored lengths")

    def tensors(self, entries: dict, table: ShardTable) -> dict[str, TensorEntry]:
        """Tensor entries over the table, checked together: their row ranges tile the table in
        order, boxes lie inside their tensor's shape, and each shard's size is its box in its dtype."""
        out: dict[str, TensorEntry] = {}
        itemsizes: dict[str, int] = {}  # looked up once per distinct dtype
        shapes, ndims, sizes, counts = [], [], [], []
        ones = (1,) * table.ndim
        position = 0
        for name, entry in entries.items():
            if not isinstance(entry, dict):
                raise self.fail("tensor entry is not an object", name)
            dtype = entry.get("dtype")
            size = itemsizes.get(dtype) if isinstance(dtype, str) else None
            if size is None:
                size = itemsizes[dtype] = self.itemsize_of(dtype, name)
            shape = self.ints(entry.get("shape"), name, "shape")
            if len(shape) > MAX_NDIM or math.prod(shape) * size > INT64_MAX:
                raise self.fail(f"shape {list(shape)} is too large for an int64 byte count", name)
            rows = self.ints(entry.get("shards"), name, "shards")
            if len(rows) != 2 or rows[0] != position or position + rows[1] > table.count \
                    or (rows[1] and len(shape) > table.ndim):
                raise self.fail("tensor shard ranges must tile the shard table in order", name)
            first, count = rows
            shapes.append((shape + ones)[:table.ndim])  # a tensor without rows may have more dims
            ndims.append(len(shape))
            sizes.append(size)
            counts.append(count)
            position += count
            out[name] = TensorEntry.from_table(name, dtype, shape, table, first, count)
        if position != table.count:
            raise self.fail("tensor shard ranges must tile the shard table in order")
        # Each tensor's shape, rank and item size repeated over its rows.
        rows_shape = np.repeat(np.array(shapes, dtype=np.int64).reshape(len(shapes), table.ndim), counts, axis=0)
        rows_ndim = np.repeat(np.array(ndims, dtype=np.int64), counts)
        rows_itemsize = np.repeat(np.array(sizes, dtype=np.int64), counts)
        padding = np.arange(table.ndim)[None, :] >= rows_ndim[:, None]
        # offsets <= shape and lengths <= shape - offsets: never an int64 sum that could wrap
        outside = np.any((table.offsets < 0) | (table.lengths < 0) | (table.offsets > rows_shape)
                         | (table.lengths > rows_shape - table.offsets)
                         | (padding & ((table.offsets != 0) | (table.lengths != 1))), axis=1)
        if np.any(outside):
            row = int(np.argmax(outside))
            owner = next(n for n, e in out.items() if e._first <= row < e._first + e._count)
            raise self.fail("a shard box lies outside its tensor's global shape", owner)
        if np.any(np.prod(table.lengths, axis=1) * rows_itemsize != table.nbytes):
            raise self.fail("a shard's byte length does not match its box and dtype")
        return out

    def object(self, name: str, entry: Any, world_size: int) -> ObjectEntry:
        if not isinstance(entry, dict):
            raise self.fail("object entry is not an object", name)
        records = []
        rows = entry.get("records")
        if type(rows) is not list:
            raise self.fail("object 'records' must be a list", name)
        for row in rows:
            if not isinstance(row, list) or len(row) != 5:
                raise self.fail("malformed object record", name)
            rng = self.byte_range(row[0], row[1], row[2], row[4], name)
            tree = row[3]
            if type(tree) is not int or not 0 <= tree <= rng.nbytes:
                raise self.fail("object tree length out of range", name)
            records.append((rng, tree))
        ranks = entry.get("ranks")
        if (
            not isinstance(ranks, list)
            or len(ranks) != world_size
            or not all(type(r) is int and -1 <= r < len(records) for r in ranks)
        ):
            raise self.fail("object 'ranks' must index its records once per saved rank", name)
        return ObjectEntry(name, records, ranks)

    def byte_range(self, file: Any, offset: Any, nbytes: Any, crcs: Any, name: str) -> ByteRange:
        if not (type(file) is int and 0 <= file < self.nfiles):
            raise self.fail(f"file index {file!r} out of range", name)
        if not (type(offset) is int and type(nbytes) is int and offset >= 0 and nbytes >= 0
                and offset + nbytes <= INT64_MAX):
            raise self.fail("byte offset/length must be non-negative int64 integers", name)
        if not isinstance(crcs, list) or not all(type(c) is int and 0 <= c < 2**32 for c in crcs):
            raise self.fail("checksums must be a list of 32-bit integers", name)
        if len(crcs) != max(1, -(-nbytes // self.chunk)):
            raise self.fail("a record's checksum count does not match its size", name)
        return ByteRange(file, offset, nbytes, tuple(crcs))

    def itemsize_of(self, dtype: Any, name: str) -> int:
        try:
            return itemsize(dtype_from_name(dtype))
        except (KeyError, TypeError):
            raise self.fail(f"unknown dtype {dtype!r}", name) from None

    def ints(self, value: Any, name: str, what: str) -> tuple[int, ...]:
        # ``type(v) is int`` also refuses bools; checked per tensor, so kept to two passes in C
        if (type(value) is not list or not all(type(v) is int for v in value) or min(value, default=0) < 0
                or max(value, default=0) > INT64_MAX):
            raise self.fail(f"'{what}' must be a list of non-negative int64 integers", name)
        return tuple(value)

    def dict_of(self, doc: dict, key: str) -> dict:
        value = doc.get(key)
        if not isinstance(value, dict):
            raise self.fail(f"'{key}' must be an object")
        return value

    def int_of(self, doc: dict, key: str, minimum: int, maximum: int = INT64_MAX) -> int:
        value = doc.get(key)
        if type(value) is not int or not minimum <= value <= maximum:
            raise self.fail(f"'{key}' must be an integer in [{minimum}, {maximum}]")
        return value

    def optional(self, doc: dict, key: str, types: tuple[type, ...], default: Any) -> Any:
        """An optional field of one of ``types`` (exactly: a bool is not an int here), else ``default``."""
        value = doc.get(key, default)
        if type(value) not in types or (type(value) is float and not math.isfinite(value)):
            raise self.fail(f"'{key}' must be of type {' or '.join(t.__name__ for t in types)}")
        return value

    def optional_step(self, doc: dict) -> int | None:
        """The training step (absent in manifests that did not record one; readers before it ignore it)."""
        if doc.get("step") is None:
            return None
        return self.int_of(doc, "step", minimum=0)

    def compression(self, doc: dict) -> Compression | None:
        """What the save asked for (informational; absent where it compressed nothing)."""
        value = doc.get("compression")
        if value is None:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("codec"), str) or type(value.get("level")) is not int:
            raise self.fail("'compression' must be an object with a string 'codec' and an integer 'level'")
        try:
            return Compression(value["codec"], value["level"])
        except ValueError as exc:
            raise self.fail(f"'compression': {exc}") from None

    def seconds_since_epoch(self, doc: dict, key: str) -> float:
        """An optional time stamp (0 when absent), within what a date can show."""
        value = self.optional(doc, key, (int, float), 0.0)
        if not -_MAX_EPOCH_SECONDS <= value <= _MAX_EPOCH_SECONDS:
            raise self.fail(f"'{key}' is {value}, not a time in seconds since 1970 (at most {_MAX_EPOCH_SECONDS:g})")
        return float(value)

    def str_of(self, doc: dict, key: str) -> str:
        value = doc.get(key)
        if not isinstance(value, str):
            raise self.fail(f"'{key}' must be a string")
        return value


# Year 5138: far beyond any checkpoint, well within what floats and datetime can represent.
_MAX_EPOCH_SECONDS = 1e11


def _safe_relpath(name: str) -> bool:
    parts = name.split("/")
    return (bool(name) and not name.startswith("/") and "\\" not in name and min(map(ord, name)) >= 0x20
            and all(p not in ("", ".", "..") for p in parts))
