"""What a rank is told to write (its share of the global save plan) and the writes it then makes."""

from __future__ import annotations

from dataclasses import dataclass, field
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

    def to_wire(self) -> list[Any]:
        return [self.whole, [[p.index, list(p.offsets), list(p.lengths)] for p in self.parts]]

    @staticmethod
    def from_wire(wire: list[Any]) -> "RankAssignment":
        whole, parts = wire
        return RankAssignment(whole, [SplitPart(i, tuple(o), tuple(n)) for i, o, n in parts])


@dataclass(slots=True)
class PieceWrite:
    """Local piece ``index`` (or ``part`` of it) to write. ``data`` is the tensor holding exactly its
    bytes, or a function producing that tensor when it is written (streaming tools keep one piece
    in memory at a time); ``nbytes`` is its size either way."""

    index: int
    part: SplitPart | None
    data: torch.Tensor | Callable[[], torch.Tensor]
    nbytes: int

    @staticmethod
    def of(index: int, part: SplitPart | None, tensor: torch.Tensor) -> "PieceWrite":
        return PieceWrite(index, part, tensor, tensor.numel() * tensor.element_size())

    def tensor(self) -> torch.Tensor:
        return self.data() if callable(self.data) else self.data


@dataclass(frozen=True, slots=True)
class ValueWrite:
    """A non-tensor value's record to write: ``data`` is the encoded tree (its first ``tree_nbytes``
    bytes) followed by its blobs, copied when the write is made, so the value may change at once.
    ``ranks`` are the saved ranks the record stands for; None means the writing rank alone."""

    name: str
    data: bytes
    tree_nbytes: int
    used_pickle: bool = False
    ranks: tuple[int, ...] | None = None

    @staticmethod
    def of(name: str, encoded: EncodedValue, ranks: tuple[int, ...] | None = None) -> "ValueWrite":
        return ValueWrite(name, b"".join(encoded.chunks()), len(encoded.tree), encoded.used_pickle, ranks)
