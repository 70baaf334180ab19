"""A read op: one saved shard's bytes that fill part of one wanted piece (the load plan's unit)."""

from __future__ import annotations

from dataclasses import dataclass

from bcp.layout.box import Box
from bcp.layout.piece import Piece
from bcp.layout.shard_table import ShardEntry


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

    def to_wire(self) -> list:
        return [self.reads, self.transfer, list(self.peers)]

    @staticmethod
    def from_wire(wire: list) -> "ReadRole":
        reads, transfer, peers = wire
        return ReadRole(reads, transfer, tuple(peers))


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

    def to_wire(self) -> list:
        return [self.tensor, self.shard_index, list(self.offsets), list(self.lengths), self.nbytes]

    @staticmethod
    def from_wire(wire: list) -> "ReadRequest":
        tensor, shard_index, offsets, lengths, nbytes = wire
        return ReadRequest(tensor, shard_index, tuple(offsets), tuple(lengths), nbytes)
