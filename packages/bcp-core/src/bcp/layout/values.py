"""Safe encoding of non-tensor values (extra state, RNG states, hyper-parameters, ...).

A value becomes a JSON tree plus a list of binary blobs (tensor, array and bytes contents). The
allowed types are part of the format (``docs/format.md``); anything else fails at save time naming
the key and type, unless the caller opts in to pickling, which marks the checkpoint as unsafe.
Decoding builds values only from those types, so a hostile record cannot run code.

Encoded with ``extract``, a value keeps none of its tensors: each tensor reached through dicts,
lists and tuples is handed to ``extract`` under a name of its own (``<key>/<segment>/...``,
:func:`tensor_refs`) and the tree holds ``{"$ref": "<segment>/..."}`` (the name after the value's
own, so a renamed value keeps its references) in its place: the tensor is saved as a checkpoint
tensor, and the record keeps only the value's other leaves and its shape. Decoding resolves each
reference through ``resolve``.
"""

from __future__ import annotations

import json
import math
import pathlib
import pickle
from typing import Any, Callable, Iterator

import numpy as np
import torch

from bcp.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedValueError
from bcp.layout.dtypes import dtype_from_name, dtype_name, itemsize
from bcp.layout.shards import is_dtensor

_MAX_NDIM = 1024  # as for tensors in the shard table: a record's shape cannot cost much memory


#: Receives each tensor a value holds, under the name its reference gives (``encode_value``).
Extract = Callable[[str, torch.Tensor], None]
#: The tensor a reference names (``decode_value``).
Resolve = Callable[[str], Any]


class EncodedValue:
    """An encoded value: ``tree`` (JSON bytes) followed by ``blobs`` make one record; ``refs`` is
    how many tensors it refers to instead of holding them."""

    def __init__(self, tree: bytes, blobs: list[memoryview], used_pickle: bool, refs: int = 0) -> None:
        self.tree = tree
        self.blobs = blobs
        self.used_pickle = used_pickle
        self.refs = refs

    @property
    def nbytes(self) -> int:
        return len(self.tree) + sum(b.nbytes for b in self.blobs)

    def chunks(self) -> list[memoryview]:
        return [memoryview(self.tree), *self.blobs]


def encode_value(value: Any, *, key: str, allow_pickle: bool = False, extract: Extract | None = None) -> EncodedValue:
    """``value`` as one record. Blobs are views of the value's own memory (tensors, arrays): the
    caller copies the record where the value may change before it is written. With ``extract``,
    tensors become references (module docstring)."""
    encoder = _Encoder(key, allow_pickle, extract)
    tree = json.dumps(encoder.encode(value, key, key), separators=(",", ":"), allow_nan=False).encode()
    return EncodedValue(tree, encoder.blobs, encoder.used_pickle, encoder.refs)


def tensor_refs(value: Any, key: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``encode_value(value, key=key, extract=...)`` would extract, with their names:
    a live value's tensors by the names its saved references carry."""
    if isinstance(value, torch.Tensor):
        yield key, value
    elif _has_children(value):
        for segment, child in zip(child_segments(value), _children(value)):
            yield from tensor_refs(child, f"{key}/{segment}")


def child_segments(container: Any) -> list[str]:
    """The name segment of each item of a dict, list or tuple, in order: list and tuple items by
    index; dict keys as themselves (``%`` and ``/`` escaped), integer keys in decimal, other keys
    as ``%<type>:<repr>``; a segment already taken (an integer key beside the same string) as
    ``%#<position>``. Save and load derive the same names from values of the same shape."""
    if not isinstance(container, dict):
        return [str(i) for i in range(len(container))]
    taken: set[str] = set()
    out = []
    for position, k in enumerate(container):
        segment = _key_segment(k)
        if segment in taken:
            segment = f"%#{position}"
        taken.add(segment)
        out.append(segment)
    return out


def _key_segment(k: Any) -> str:
    if type(k) is str:
        escaped = k.replace("%", "%25").replace("/", "%2F")
        return escaped or "%00"
    if type(k) is int:
        return str(k)
    return "%" + f"{type(k).__name__}:{k!r}".replace("%", "%25").replace("/", "%2F")


def _has_children(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple))


def _children(value: Any) -> Iterator[Any]:
    return iter(value.values()) if isinstance(value, dict) else iter(value)


def decode_value(record: memoryview, tree_nbytes: int, *, key: str, path: str | None,
                 allow_pickle: bool = False, resolve: Resolve | None = None) -> Any:
    """Rebuild a value from one record (tree JSON + blobs). Tensors come back on the CPU; a
    reference to a tensor is replaced by ``resolve(<key>/<reference>)``. A malformed record
    fails with ``CorruptCheckpointError``, whatever it holds."""
    try:
        tree = json.loads(bytes(record[:tree_nbytes]))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CorruptCheckpointError("value record is not valid JSON", path=path, key=key) from None
    decoder = _Decoder(record[tree_nbytes:], key, path, allow_pickle, resolve)
    try:
        return decoder.decode(tree)
    except RecursionError:
        raise decoder.fail("nested too deeply") from None
    except (TypeError, ValueError, RuntimeError, OverflowError, IndexError) as exc:
        # The tags below check what they build on; this catches what their types' constructors
        # refuse (an unhashable key, a complex of three parts, an unknown device name).
        raise decoder.fail(f"{type(exc).__name__}: {exc}") from None


class _Encoder:
    def __init__(self, key: str, allow_pickle: bool, extract: Extract | None) -> None:
        self.key = key
        self.allow_pickle = allow_pickle
        self.extract = extract
        self.used_pickle = False
        self.refs = 0
        self.blobs: list[memoryview] = []
        self.offset = 0

    def blob(self, data: memoryview) -> list[int]:
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        at = [self.offset, data.nbytes]
        self.blobs.append(data)
        self.offset += data.nbytes
        return at

    def encode(self, v: Any, where: str, name: str | None) -> Any:
        """``v`` as a tree node; ``where`` names it in errors, ``name`` is the name a tensor there
        is extracted under (None inside sets and keys, whose tensors stay in the record)."""
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int) and type(v) is int:
            return v
        if isinstance(v, float) and type(v) is float:
            return v if math.isfinite(v) else {"$float": repr(v)}
        if isinstance(v, (list, tuple, set, frozenset)) and type(v) in (list, tuple, set, frozenset):
            names = self.names(v, name) if type(v) in (list, tuple) else [None] * len(v)
            items = [self.encode(x, f"{where}[{i}]", n) for i, (x, n) in enumerate(zip(v, names))]
            return items if type(v) is list else {"$" + type(v).__name__: items}
        if isinstance(v, dict):
            names = self.names(v, name)
            return {"$dict": [[self.encode(k, f"{where}.<key>", None), self.encode(x, f"{where}.{k}", n)]
                              for (k, x), n in zip(v.items(), names)]}
        if isinstance(v, torch.Tensor):
            if self.extract is not None and name is not None and not is_dtensor(v):
                self.check_strided(v, where)
                self.extract(name, v)
                self.refs += 1
                return {"$ref": name[len(self.key) + 1:]}
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
            return {"$complex": [self.encode(v.real, where, None), self.encode(v.imag, where, None)]}
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
            return self.encode(base(v), where, name)
        if self.allow_pickle:
            self.used_pickle = True
            return {"$pickle": self.blob(memoryview(pickle.dumps(v)))}
        raise UnsupportedValueError(
            f"cannot store a value of type {type(v).__module__}.{type(v).__qualname__} at {where!r}: "
            "bcp stores only primitives, lists/tuples/sets/dicts, tensors, numpy arrays and bytes; "
            "convert it, or pass allow_pickle=True to store it unsafely",
            key=self.key,
        )

    def names(self, container: Any, name: str | None) -> list[str | None]:
        if name is None or self.extract is None:
            return [None] * len(container)
        return [f"{name}/{segment}" for segment in child_segments(container)]

    def check_strided(self, t: torch.Tensor, where: str) -> None:
        if t.is_sparse or t.layout != torch.strided:
            raise UnsupportedValueError(f"sparse or non-strided tensor at {where!r}", key=self.key)

    def tensor(self, t: torch.Tensor, where: str) -> dict:
        self.check_strided(t, where)
        if is_dtensor(t):
            raise UnsupportedValueError(
                f"a DTensor at {where!r} inside a per-rank value; put it in the model or optimizer state",
                key=self.key,
            )
        cpu = t.detach().to("cpu").contiguous()
        raw = cpu.reshape(-1).view(torch.uint8) if cpu.numel() else torch.empty(0, dtype=torch.uint8)
        # Through DLPack, not Tensor.numpy(): that marks the storage as never to be resized, and a
        # later load could no longer hand such a tensor its staged memory.
        return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "at": self.blob(memoryview(np.from_dlpack(raw)))}


class _Decoder:
    def __init__(self, blobs: memoryview, key: str, path: str | None, allow_pickle: bool,
                 resolve: Resolve | None) -> None:
        self.blobs = blobs
        self.key = key
        self.path = path
        self.allow_pickle = allow_pickle
        self.resolve = resolve

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

    def tag_ref(self, body: Any) -> Any:
        # Relative to the value's own name: a record refers only to tensors saved under it.
        if not isinstance(body, str) or not body:
            raise self.fail(f"reference {body!r}")
        if self.resolve is None:
            raise self.fail(f"reference {body!r} with nothing to resolve it")
        return self.resolve(f"{self.key}/{body}")

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
