"""Safe encoding of non-tensor values (extra state, RNG states, hyper-parameters, ...).

A value becomes a JSON tree plus a list of binary blobs (tensor, array and bytes contents). The
allowed types are part of the format (``docs/format.md``); anything else fails at save time naming
the key and type, unless the caller opts in to pickling, which marks the checkpoint as unsafe.
Decoding builds values only from those types, so a hostile record cannot run code.
"""

from __future__ import annotations

import json
import math
import pathlib
import pickle
from typing import Any

import numpy as np
import torch

from bcp.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedValueError
from bcp.layout.dtypes import dtype_from_name, dtype_name, itemsize

_MAX_NDIM = 1024  # as for tensors in the shard table: a record's shape cannot cost much memory


class EncodedValue:
    """An encoded value: ``tree`` (JSON bytes) followed by ``blobs`` make one record."""

    def __init__(self, tree: bytes, blobs: list[memoryview], used_pickle: bool) -> None:
        self.tree = tree
        self.blobs = blobs
        self.used_pickle = used_pickle

    @property
    def nbytes(self) -> int:
        return len(self.tree) + sum(b.nbytes for b in self.blobs)

    def chunks(self) -> list[memoryview]:
        return [memoryview(self.tree), *self.blobs]


def encode_value(value: Any, *, key: str, allow_pickle: bool = False) -> EncodedValue:
    encoder = _Encoder(key, allow_pickle)
    tree = json.dumps(encoder.encode(value, key), separators=(",", ":"), allow_nan=False).encode()
    return EncodedValue(tree, encoder.blobs, encoder.used_pickle)


def decode_value(record: memoryview, tree_nbytes: int, *, key: str, path: str | None,
                 allow_pickle: bool = False) -> Any:
    """Rebuild a value from one record (tree JSON + blobs). Tensors come back on the CPU. A
    malformed record fails with ``CorruptCheckpointError``, whatever it holds."""
    try:
        tree = json.loads(bytes(record[:tree_nbytes]))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CorruptCheckpointError("value record is not valid JSON", path=path, key=key) from None
    decoder = _Decoder(record[tree_nbytes:], key, path, allow_pickle)
    try:
        return decoder.decode(tree)
    except RecursionError:
        raise decoder.fail("nested too deeply") from None
    except (TypeError, ValueError, RuntimeError, OverflowError, IndexError) as exc:
        # The tags below check what they build on; this catches what their types' constructors
        # refuse (an unhashable key, a complex of three parts, an unknown device name).
        raise decoder.fail(f"{type(exc).__name__}: {exc}") from None


class _Encoder:
    def __init__(self, key: str, allow_pickle: bool) -> None:
        self.key = key
        self.allow_pickle = allow_pickle
        self.used_pickle = False
        self.blobs: list[memoryview] = []
        self.offset = 0

    def blob(self, data: memoryview) -> list[int]:
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        at = [self.offset, data.nbytes]
        self.blobs.append(data)
        self.offset += data.nbytes
        return at

    def encode(self, v: Any, where: str) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int) and type(v) is int:
            return v
        if isinstance(v, float) and type(v) is float:
            return v if math.isfinite(v) else {"$float": repr(v)}
        if isinstance(v, (list, tuple, set, frozenset)) and type(v) in (list, tuple, set, frozenset):
            items = [self.encode(x, f"{where}[{i}]") for i, x in enumerate(v)]
            return items if type(v) is list else {"$" + type(v).__name__: items}
        if isinstance(v, dict):
            return {"$dict": [[self.encode(k, f"{where}.<key>"), self.encode(x, f"{where}.{k}")]
                              for k, x in v.items()]}
        if isinstance(v, torch.Tensor):
            return {"$tensor": self.tensor(v, where)}
        if isinstance(v, np.ndarray) and v.dtype.kind in "biufc":
            array = np.ascontiguousarray(v)
            return {"$ndarray": {"dtype": array.dtype.str, "shape": list(array.shape),
                                 "at": self.blob(memoryview(array.reshape(-1).view(np.uint8)))}}
        if isinstance(v, np.generic) and v.dtype.kind in "biufc":
            return {"$npscalar": {"dtype": v.dtype.str, "at": self.blob(memoryview(v.tobytes()))}}
        if isinstance(v, (bytes, bytearray)):
            return {"$" + type(v).__name__: self.blob(memoryview(bytes(v)))}
        if isinstance(v, complex):
            return {"$complex": [self.encode(v.real, where), self.encode(v.imag, where)]}
        if isinstance(v, torch.dtype):
            return {"$dtype": dtype_name(v)}
        if isinstance(v, torch.device):
            return {"$device": str(v)}
        if isinstance(v, torch.Size):
            return {"$size": list(v)}
        if isinstance(v, pathlib.PurePath):
            return {"$path": str(v)}
        if isinstance(v, (int, float, str, tuple, list)):
            # Subclasses (IntEnum, namedtuple, ...) are stored as their plain base value.
            base = next(b for b in (bool, int, float, str, tuple, list) if isinstance(v, b))
            return self.encode(base(v), where)
        if self.allow_pickle:
            self.used_pickle = True
            return {"$pickle": self.blob(memoryview(pickle.dumps(v)))}
        raise UnsupportedValueError(
            f"cannot store a value of type {type(v).__module__}.{type(v).__qualname__} at {where!r}: "
            "bcp stores only primitives, lists/tuples/sets/dicts, tensors, numpy arrays and bytes; "
            "convert it, or pass allow_pickle=True to store it unsafely",
            key=self.key,
        )

    def tensor(self, t: torch.Tensor, where: str) -> dict:
        if t.is_sparse or t.layout != torch.strided:
            raise UnsupportedValueError(f"sparse or non-strided tensor at {where!r}", key=self.key)
        if hasattr(t, "_local_tensor"):
            raise UnsupportedValueError(
                f"a DTensor at {where!r} inside a per-rank value; put it in the model or optimizer state",
                key=self.key,
            )
        cpu = t.detach().to("cpu").contiguous()
        raw = cpu.reshape(-1).view(torch.uint8) if cpu.numel() else torch.empty(0, dtype=torch.uint8)
        return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "at": self.blob(memoryview(raw.numpy()))}


class _Decoder:
    def __init__(self, blobs: memoryview, key: str, path: str | None, allow_pickle: bool) -> None:
        self.blobs = blobs
        self.key = key
        self.path = path
        self.allow_pickle = allow_pickle

    def fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"malformed value record: {what}", path=self.path, key=self.key)

    def blob(self, at: Any) -> memoryview:
        if (not isinstance(at, list) or len(at) != 2 or not all(type(x) is int and x >= 0 for x in at)
                or at[0] + at[1] > self.blobs.nbytes):
            raise self.fail(f"blob reference {at!r} out of range")
        return self.blobs[at[0]: at[0] + at[1]]

    def decode(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.decode(x) for x in node]
        if not isinstance(node, dict) or len(node) != 1:
            raise self.fail("unexpected node")
        (tag, body), = node.items()
        handler = getattr(self, "tag_" + tag.lstrip("$"), None) if tag.startswith("$") else None
        if handler is None:
            raise self.fail(f"unknown tag {tag!r}")
        return handler(body)

    def tag_dict(self, body: Any) -> dict:
        if not isinstance(body, list) or not all(isinstance(p, list) and len(p) == 2 for p in body):
            raise self.fail("dict body")
        return {_hashable(self.decode(k)): self.decode(v) for k, v in body}

    def tag_tuple(self, body: Any) -> tuple:
        return tuple(self.decode(body))

    def tag_set(self, body: Any) -> set:
        return {_hashable(x) for x in self.decode(body)}

    def tag_frozenset(self, body: Any) -> frozenset:
        return frozenset(_hashable(x) for x in self.decode(body))

    def tag_float(self, body: Any) -> float:
        if body not in ("nan", "inf", "-inf"):
            raise self.fail("float literal")
        return float(body)

    def tag_complex(self, body: Any) -> complex:
        return complex(*self.decode(body))

    def tag_bytes(self, body: Any) -> bytes:
        return bytes(self.blob(body))

    def tag_bytearray(self, body: Any) -> bytearray:
        return bytearray(self.blob(body))

    def tag_dtype(self, body: Any) -> torch.dtype:
        try:
            return dtype_from_name(body)
        except (KeyError, TypeError):
            raise self.fail(f"dtype {body!r}") from None

    def tag_device(self, body: Any) -> torch.device:
        return torch.device(self.text(body, "device"))

    def tag_size(self, body: Any) -> torch.Size:
        return torch.Size(self.decode(body))

    def tag_path(self, body: Any) -> pathlib.Path:
        return pathlib.Path(self.text(body, "path"))

    def text(self, body: Any, what: str) -> str:
        if not isinstance(body, str):
            raise self.fail(f"{what} must be a string")
        return body

    def tag_tensor(self, body: Any) -> torch.Tensor:
        dtype = self.tag_dtype(body.get("dtype") if isinstance(body, dict) else None)
        shape = self.shape(body, "tensor")
        data = self.blob(body.get("at"))
        # compared before allocating: a record may claim any shape
        if data.nbytes != math.prod(shape) * itemsize(dtype):
            raise self.fail("tensor byte length does not match its shape and dtype")
        out = torch.empty(shape, dtype=dtype)
        if data.nbytes:
            out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        return out

    def tag_ndarray(self, body: Any) -> np.ndarray:
        dtype = self.np_dtype(body)
        shape = self.shape(body, "array")
        data = self.blob(body.get("at"))
        if data.nbytes != math.prod(shape) * dtype.itemsize:
            raise self.fail("array byte length does not match its shape and dtype")
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()

    def tag_npscalar(self, body: Any) -> np.generic:
        dtype = self.np_dtype(body)
        data = self.blob(body.get("at"))
        if data.nbytes != dtype.itemsize:
            raise self.fail("numpy scalar length")
        return np.frombuffer(data, dtype=dtype)[0]

    def shape(self, body: dict, what: str) -> list[int]:
        shape = body.get("shape")
        if (type(shape) is not list or len(shape) > _MAX_NDIM
                or not all(type(s) is int and 0 <= s < 2**63 for s in shape)):
            raise self.fail(f"{what} shape")
        return shape

    def np_dtype(self, body: Any) -> np.dtype:
        try:
            dtype = np.dtype(body["dtype"])
        except (TypeError, KeyError, ValueError):
            raise self.fail("numpy dtype") from None
        if dtype.kind not in "biufc":
            raise self.fail(f"numpy dtype {dtype} is not numeric")
        return dtype

    def tag_pickle(self, body: Any) -> Any:
        if not self.allow_pickle:
            raise UnsafeCheckpointError(
                "this value was pickled at save time; loading it can run code. "
                "Pass allow_pickle=True only for checkpoints you trust",
                path=self.path, key=self.key,
            )
        return pickle.loads(bytes(self.blob(body)))


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value
