"""Typed records that cross a boundary (rank to rank, training process to writer process) as plain
data: a mapping of their field names, plus ``version`` (the record's layout) and, for the items of a
list that holds several kinds, ``kind``. A field added later is read from an older sender as its
default, and a field an older reader does not know is ignored, so adding one never shifts the
others. The plain data travels as msgpack (``coord.consensus``, ``process_wire``), never pickle.

Every layer uses it (as it does ``bcp.errors``), and it imports nothing but the standard library:
the writer process starts with it."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, ClassVar, Mapping, TypeVar

R = TypeVar("R", bound="WireRecord")


class WireRecord:
    """Base of a frozen, slotted dataclass that travels by field name (``to_wire``/``from_wire``).
    ``VERSION`` is its layout; ``KIND`` names it among the kinds of a mixed list (``kinds``);
    ``NESTED`` decodes the fields that hold records (field name -> decoder of its plain data)."""

    __slots__ = ()
    VERSION: ClassVar[int] = 1
    KIND: ClassVar[str | None] = None
    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"version": self.VERSION}
        if self.KIND is not None:
            wire["kind"] = self.KIND
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            wire[field.name] = _plain(getattr(self, field.name))
        return wire

    @classmethod
    def from_wire(cls: type[R], wire: Mapping[str, Any]) -> R:
        """The record from its plain data; fields missing there (an older sender's) take their
        defaults, and a field without one that is missing is a ``ValueError``."""
        values = {}
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            if field.name in wire:
                value = wire[field.name]
                decode = cls.NESTED.get(field.name)
                values[field.name] = decode(value) if decode is not None and value is not None else value
            elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise ValueError(f"{cls.__name__} without its field {field.name!r}")
        return cls(**values)


def kinds(*classes: type[WireRecord]) -> Callable[[Mapping[str, Any]], WireRecord]:
    """The decoder of a record that is one of ``classes``, told apart by their ``KIND``."""
    by_kind = {cls.KIND: cls for cls in classes}

    def decode(wire: Mapping[str, Any]) -> WireRecord:
        cls = by_kind.get(wire.get("kind"))
        if cls is None:
            raise ValueError(f"a record of unknown kind {wire.get('kind')!r} (known: {sorted(by_kind)})")
        return cls.from_wire(wire)
    return decode


def list_of(decode: Callable[[Any], Any]) -> Callable[[list[Any]], list[Any]]:
    """The decoder of a list whose items ``decode`` reads."""
    return lambda wire: [decode(item) for item in wire]


def _plain(value: Any) -> Any:
    if hasattr(value, "to_wire"):  # a record, or a value with a wire form of its own (``RankWrites``)
        return value.to_wire()
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value
