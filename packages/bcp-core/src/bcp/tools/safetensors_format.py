"""The safetensors file format, which is public: an 8-byte little-endian header length, a JSON
header giving each tensor's dtype, shape and ``data_offsets`` (relative to the end of the header)
plus an optional ``__metadata__`` map of strings, then the raw little-endian tensor bytes.

Written here by streaming (the header is computed from shapes alone, then tensors follow one by
one) and read here with every header field checked, so the tools need no extra package and a
hostile file can at worst be refused.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

from bcp.engine.bytes_of import byte_view
from bcp.errors import CorruptCheckpointError, UnsupportedValueError
from bcp.layout.dtypes import itemsize

_CODES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64",
}
DTYPES: dict[str, torch.dtype] = {code: getattr(torch, name) for code, name in _CODES.items() if hasattr(torch, name)}
CODE_OF: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}
# The reference implementation refuses larger headers; so do we, before reading one.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data section
    end: int


def code_of(dtype: torch.dtype, name: str) -> str:
    code = CODE_OF.get(dtype)
    if code is None:
        raise UnsupportedValueError(f"safetensors has no code for dtype {dtype}", key=name)
    return code


def encode_header(tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                  metadata: dict[str, str]) -> tuple[bytes, list[Entry]]:
    """The bytes that start a file holding ``tensors`` in this order, and where each one goes."""
    entries, offset = [], 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * itemsize(dtype)
        entries.append(Entry(name, dtype, tuple(shape), offset, offset + nbytes))
        offset += nbytes
    doc: dict[str, object] = {METADATA_KEY: metadata} if metadata else {}
    for e in entries:
        doc[e.name] = {"dtype": code_of(e.dtype, e.name), "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    header = json.dumps(doc, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # so the data section, and each tensor in it, stays aligned
    return struct.pack("<Q", len(header)) + header, entries


class SafetensorsFile:
    """A safetensors file with its header parsed and checked; tensors are read one at a time."""

    def __init__(self, path: str) -> None:
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise self.fail("shorter than the 8-byte header length")
            (header_nbytes,) = struct.unpack("<Q", prefix)
            if header_nbytes > min(MAX_HEADER_BYTES, size - 8):
                raise self.fail(f"header length {header_nbytes} exceeds the file or the {MAX_HEADER_BYTES}-byte limit")
            header = f.read(header_nbytes)
        self.data_start = 8 + header_nbytes
        self.metadata, self.entries = self._parse(header, size - self.data_start)

    def fail(self, what: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"invalid safetensors file: {what}", path=self.path, key=key)

    def read(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        view = byte_view(out)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + entry.begin)
            if f.readinto(view) != view.nbytes:
                raise self.fail("file ends inside a tensor", name)
        return out

    def _parse(self, header: bytes, data_nbytes: int) -> tuple[dict[str, str], dict[str, Entry]]:
        try:
            doc = json.loads(header)
        except (ValueError, UnicodeDecodeError) as exc:
            raise self.fail(f"header is not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise self.fail("header is not a JSON object")
        metadata = doc.pop(METADATA_KEY, {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self.fail("__metadata__ must map strings to strings")
        parsed = sorted((self._entry(name, spec, data_nbytes) for name, spec in doc.items()), key=lambda e: e.begin)
        entries = {e.name: e for e in parsed}  # in file order, so reading them in turn reads the file forward
        spans = [(e.begin, e.end, e.name) for e in parsed if e.end > e.begin]
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
            if begin < end:
                raise self.fail(f"tensors {first!r} and {second!r} overlap")
        return metadata, entries

    def _entry(self, name: str, spec: object, data_nbytes: int) -> Entry:
        if not isinstance(spec, dict):
            raise self.fail("tensor entry is not an object", name)
        dtype = DTYPES.get(spec.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise self.fail(f"unknown dtype {spec.get('dtype')!r}", name)
        shape, offsets = spec.get("shape"), spec.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise self.fail("shape must be a list of non-negative integers", name)
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_nbytes):
            raise self.fail(f"data_offsets {offsets!r} are not a range inside the file", name)
        if offsets[1] - offsets[0] != math.prod(shape) * itemsize(dtype):
            raise self.fail("data_offsets do not span shape x dtype size", name)
        return Entry(name, dtype, tuple(shape), offsets[0], offsets[1])
