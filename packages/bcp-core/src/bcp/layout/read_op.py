"""A read op: one saved shard's bytes that fill part of one wanted piece (the load plan's unit)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bcp.layout.box import Box
from bcp.layout.piece import Piece
from bcp.layout.shard_table import ShardEntry

#: The layout of the read-once exchange's lists (:meth:`ReadRequest.list_to_wire`, :meth:`ReadRole.list_to_wire`).
WIRE_VERSION = 1


@dataclass(slots=True)
class ReadOp:
    """Copy ``region`` (global coordinates) of a saved shard into a destination piece."""

    piece: Piece
    shard: ShardEntry
    region: Box
    #: Position of ``shard`` among its tensor's shards: with the tensor name, it names the shard.
    shard_index: int


@dataclass(frozen=True, slots=True)
class ReadRole:
    """A rank's part in one of its read ops when replicas are read once: it ``reads`` the region and
    sends it to ``peers``, or receives it from ``peers[0]``. ``transfer`` numbers the shared region
    in one order that every rank follows, so sends and receives match (-1: nobody else wants it)."""

    reads: bool
    transfer: int
    peers: tuple[int, ...]

    @staticmethod
    def list_to_wire(roles: list["ReadRole"]) -> dict[str, Any]:
        """A rank's roles as columns, each by its field's name (thousands of ops per rank)."""
        return {"version": WIRE_VERSION, "reads": [role.reads for role in roles],
                "transfer": [role.transfer for role in roles], "peers": [list(role.peers) for role in roles]}

    @staticmethod
    def list_from_wire(wire: dict[str, Any]) -> list["ReadRole"]:
        return [ReadRole(reads, transfer, tuple(peers))
                for reads, transfer, peers in zip(wire["reads"], wire["transfer"], wire["peers"], strict=True)]


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """A rank's read op as the read-once planner sees it: ``region`` of shard ``shard_index`` of
    tensor ``tensor``, ``nbytes`` long."""

    tensor: str
    shard_index: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    nbytes: int

    @staticmethod
    def of(op: ReadOp) -> "ReadRequest":
        region = op.region
        return ReadRequest(op.piece.name, op.shard_index, region.offsets, region.lengths,
                           region.numel * op.piece.tensor.element_size())

    @property
    def key(self) -> tuple:
        """Equal for the requests of every rank that wants the same saved bytes."""
        return self.tensor, self.shard_index, self.offsets, self.lengths

    @staticmethod
    def list_to_wire(requests: list["ReadRequest"]) -> dict[str, Any]:
        """A rank's requests as columns, each by its field's name."""
        return {"version": WIRE_VERSION, "tensor": [r.tensor for r in requests],
                "shard_index": [r.shard_index for r in requests], "offsets": [list(r.offsets) for r in requests],
                "lengths": [list(r.lengths) for r in requests], "nbytes": [r.nbytes for r in requests]}

    @staticmethod
    def list_from_wire(wire: dict[str, Any]) -> list["ReadRequest"]:
        return [ReadRequest(tensor, shard_index, tuple(offsets), tuple(lengths), nbytes)
                for tensor, shard_index, offsets, lengths, nbytes in zip(
                    wire["tensor"], wire["shard_index"], wire["offsets"], wire["lengths"], wire["nbytes"], strict=True)]
