"""What a rank is told to write (its share of the global save plan) and the writes it then makes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from bcp.layout.values import EncodedValue


@dataclass(frozen=True, slots=True)
class SplitPart:
    """Part ``offsets``/``lengths`` (global coordinates) of local piece ``index``: a very large
    replicated piece is cut along its first dimension so that several of its holders write a part."""

    index: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(slots=True)
class RankAssignment:
    """One rank's share of the global plan: the local pieces it writes whole, and parts of others."""

    whole: list[int] = field(default_factory=list)
    parts: list[SplitPart] = field(default_factory=list)

    #: The layout of :meth:`to_wire`: each field by name, a split part as its index, offsets and lengths.
    VERSION = 1

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.VERSION, "whole": self.whole,
                "parts": [[p.index, list(p.offsets), list(p.lengths)] for p in self.parts]}

    @staticmethod
    def from_wire(wire: dict[str, Any]) -> "RankAssignment":
        return RankAssignment(wire["whole"], [SplitPart(i, tuple(o), tuple(n)) for i, o, n in wire.get("parts", [])])


@dataclass(slots=True)
class PieceWrite:
    """Local piece ``index`` (or ``part`` of it) to write. ``data`` is the tensor holding exactly its
    bytes, or a function producing that tensor when it is written (streaming tools keep one piece
    in memory at a time); ``nbytes`` is its size either way. ``crcs``, where known, are the chunk
    checksums of those bytes (computed once, when the save compared them across ranks). ``dtype``
    is the tensor's, for a produced piece whose chunks are compressed (without it they are coded as
    whole bytes; where ``data`` is a tensor, its own dtype counts)."""

    index: int
    part: SplitPart | None
    data: torch.Tensor | Callable[[], torch.Tensor]
    nbytes: int
    crcs: list[int] | None = None
    dtype: torch.dtype | None = None

    @staticmethod
    def of(index: int, part: SplitPart | None, tensor: torch.Tensor, crcs: list[int] | None = None) -> "PieceWrite":
        return PieceWrite(index, part, tensor, tensor.numel() * tensor.element_size(), crcs, tensor.dtype)

    def tensor(self) -> torch.Tensor:
        return self.data() if callable(self.data) else self.data


@dataclass(frozen=True, slots=True)
class ValueWrite:
    """A non-tensor value's record to write: ``parts`` are the encoded tree (``tree_nbytes`` bytes)
    and its blobs, one after the other. A synchronous save writes them from the value's own memory;
    an asynchronous one writes a ``snapshot`` taken before ``save`` returns, so the value may change
    at once. ``ranks`` are the saved ranks the record stands for (None: the writing rank alone);
    ``crcs``, where known, the record's chunk checksums; ``digest`` identifies its bytes across ranks."""

    name: str
    parts: tuple[bytes | memoryview, ...]
    tree_nbytes: int
    used_pickle: bool = False
    ranks: tuple[int, ...] | None = None
    crcs: tuple[int, ...] | None = None
    digest: int = 0
    #: The record refers to tensors saved beside it (``layout.values``).
    refs: bool = False

    @staticmethod
    def of(name: str, encoded: EncodedValue, crcs: tuple[int, ...] | None = None, digest: int = 0) -> "ValueWrite":
        return ValueWrite(name, tuple(encoded.chunks()), len(encoded.tree), encoded.used_pickle, None, crcs, digest,
                          encoded.refs > 0)

    @property
    def nbytes(self) -> int:
        return sum(memoryview(part).nbytes for part in self.parts)

    def joined(self) -> bytes:
        """The record as one bytes object."""
        return self.parts[0] if len(self.parts) == 1 and isinstance(self.parts[0], bytes) else b"".join(self.parts)

    def snapshot(self) -> "ValueWrite":
        """The record copied out of the value's memory."""
        return replace(self, parts=(self.joined(),))
