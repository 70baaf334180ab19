"""The manifest: the one global metadata file that describes a committed checkpoint.

It is JSON (never pickle), columnar per tensor so that a million shard entries parse in a fraction
of a second, and every field is validated on read: a hostile manifest yields a
``CorruptCheckpointError``, never code execution. ``docs/format.md`` is the specification.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from bcp.errors import CorruptCheckpointError, FormatVersionError
from bcp.layout.box import Box
from bcp.layout.dtypes import dtype_from_name

FORMAT_NAME = "bcp"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
CHECKSUM_ALGORITHM = "crc32c"
DEFAULT_CHECKSUM_CHUNK = 4 << 20


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Where bytes lie: ``files[file]`` from ``offset``, ``nbytes`` long, with one crc32c per chunk."""

    file: int
    offset: int
    nbytes: int
    crcs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ShardEntry:
    box: Box
    bytes: ByteRange


@dataclass(slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shards: list[ShardEntry] = field(default_factory=list)

    @property
    def component(self) -> str:
        return component_of(self.name)


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
    version: int = FORMAT_VERSION

    def components(self) -> set[str]:
        return {e.component for e in self.tensors.values()} | {e.component for e in self.objects.values()}

    def total_tensor_bytes(self) -> int:
        return sum(s.bytes.nbytes for e in self.tensors.values() for s in e.shards)

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "version": self.version,
            "generation": self.generation,
            "world_size": self.world_size,
            "framework": self.framework,
            "created_unix": self.created_unix,
            "writer": self.writer,
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "chunk_bytes": self.checksum_chunk},
            "unsafe_pickle": self.unsafe_pickle,
            "files": self.files,
            "tensors": {
                name: {
                    "dtype": e.dtype,
                    "shape": list(e.shape),
                    "shards": [
                        [list(s.box.offsets), list(s.box.lengths), s.bytes.file, s.bytes.offset,
                         s.bytes.nbytes, list(s.bytes.crcs)]
                        for s in e.shards
                    ],
                }
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
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def from_json(data: bytes, *, path: str | None = None) -> "Manifest":
        return _ManifestParser(path).parse(data)


def component_of(name: str) -> str:
    return name.split("/", 1)[0]


class _ManifestParser:
    """Reads a manifest defensively: every field is type-checked before use."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def fail(self, what: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"invalid manifest: {what}", path=self.path, key=key)

    def parse(self, data: bytes) -> Manifest:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise self.fail(f"not valid JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise self.fail("not a bcp manifest")
        version = doc.get("version")
        if version not in SUPPORTED_VERSIONS:
            raise FormatVersionError(
                f"format version {version!r} is not readable by this bcp (reads {SUPPORTED_VERSIONS}); "
                "upgrade bcp",
                path=self.path,
            )
        checksum = self.dict_of(doc, "checksum")
        if checksum.get("algorithm") != CHECKSUM_ALGORITHM:
            raise self.fail(f"unknown checksum algorithm {checksum.get('algorithm')!r}")
        files = doc.get("files")
        if not isinstance(files, list) or not all(isinstance(f, str) and _safe_relpath(f) for f in files):
            raise self.fail("'files' must be a list of relative paths inside the checkpoint")
        self.nfiles = len(files)
        world_size = self.int_of(doc, "world_size", minimum=1)
        return Manifest(
            version=version,
            generation=self.int_of(doc, "generation", minimum=0),
            world_size=world_size,
            framework=self.str_of(doc, "framework"),
            files=files,
            tensors={n: self.tensor(n, e) for n, e in self.dict_of(doc, "tensors").items()},
            objects={n: self.object(n, e, world_size) for n, e in self.dict_of(doc, "objects").items()},
            checksum_chunk=self.int_of(checksum, "chunk_bytes", minimum=1),
            unsafe_pickle=bool(doc.get("unsafe_pickle", False)),
            created_unix=float(doc.get("created_unix", 0.0)),
            writer=str(doc.get("writer", "")),
        )

    def tensor(self, name: str, entry: Any) -> TensorEntry:
        if not isinstance(entry, dict):
            raise self.fail("tensor entry is not an object", name)
        try:
            dtype_from_name(entry.get("dtype"))
        except (KeyError, TypeError):
            raise self.fail(f"unknown dtype {entry.get('dtype')!r}", name) from None
        shape = self.ints(entry.get("shape"), name, "shape")
        shards = entry.get("shards")
        if not isinstance(shards, list):
            raise self.fail("'shards' is not a list", name)
        parsed = []
        for row in shards:
            if not isinstance(row, list) or len(row) != 6:
                raise self.fail("malformed shard row", name)
            box = Box(self.ints(row[0], name, "offsets"), self.ints(row[1], name, "lengths"))
            if not box.within(shape):
                raise self.fail(f"shard {box} lies outside the global shape {shape}", name)
            parsed.append(ShardEntry(box, self.byte_range(row[2], row[3], row[4], row[5], name)))
        return TensorEntry(name, entry["dtype"], shape, parsed)

    def object(self, name: str, entry: Any, world_size: int) -> ObjectEntry:
        if not isinstance(entry, dict):
            raise self.fail("object entry is not an object", name)
        records = []
        for row in entry.get("records", ()):
            if not isinstance(row, list) or len(row) != 5:
                raise self.fail("malformed object record", name)
            rng = self.byte_range(row[0], row[1], row[2], row[4], name)
            tree = row[3]
            if not isinstance(tree, int) or not 0 <= tree <= rng.nbytes:
                raise self.fail("object tree length out of range", name)
            records.append((rng, tree))
        ranks = entry.get("ranks")
        if (
            not isinstance(ranks, list)
            or len(ranks) != world_size
            or not all(isinstance(r, int) and -1 <= r < len(records) for r in ranks)
        ):
            raise self.fail("object 'ranks' must index its records once per saved rank", name)
        return ObjectEntry(name, records, ranks)

    def byte_range(self, file: Any, offset: Any, nbytes: Any, crcs: Any, name: str) -> ByteRange:
        if not (isinstance(file, int) and 0 <= file < self.nfiles):
            raise self.fail(f"file index {file!r} out of range", name)
        if not (isinstance(offset, int) and isinstance(nbytes, int) and offset >= 0 and nbytes >= 0):
            raise self.fail("byte offset/length must be non-negative integers", name)
        if not isinstance(crcs, list) or not all(isinstance(c, int) and 0 <= c < 2**32 for c in crcs):
            raise self.fail("checksums must be a list of 32-bit integers", name)
        return ByteRange(file, offset, nbytes, tuple(crcs))

    def ints(self, value: Any, name: str, what: str) -> tuple[int, ...]:
        if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
            raise self.fail(f"'{what}' must be a list of non-negative integers", name)
        return tuple(value)

    def dict_of(self, doc: dict, key: str) -> dict:
        value = doc.get(key)
        if not isinstance(value, dict):
            raise self.fail(f"'{key}' must be an object")
        return value

    def int_of(self, doc: dict, key: str, minimum: int) -> int:
        value = doc.get(key)
        if not isinstance(value, int) or value < minimum:
            raise self.fail(f"'{key}' must be an integer >= {minimum}")
        return value

    def str_of(self, doc: dict, key: str) -> str:
        value = doc.get(key)
        if not isinstance(value, str):
            raise self.fail(f"'{key}' must be a string")
        return value


def _safe_relpath(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and all(p not in ("", ".", "..") for p in parts)


def chunk_count(nbytes: int, chunk: int) -> int:
    return max(1, math.ceil(nbytes / chunk))
