"""Executing a read-once plan: this rank reads its share of the regions, sends each shared region
to the ranks that need it as soon as it is read, and receives the regions other ranks read."""

from __future__ import annotations

from typing import Any

import torch

from bcp.engine.reader import ShardReader
from bcp.planning.load_plan import ReadOp
from bcp.planning.read_once import READ, RECEIVE


def read_and_share(reader: ShardReader, ops: list[ReadOp], roles: list[list[Any]], group: Any,
                   threads: int) -> int:
    """Run ``ops`` under ``roles`` (``read_once.assign_readers``) over the coordinator's gloo
    ``group`` (``coord.side_group.SideGroup``: peers are its member indices); returns the bytes
    received from other ranks."""
    received: list[tuple[ReadOp, torch.Tensor, Any]] = []
    for op, (role, transfer, peer) in zip(ops, roles):
        if role == RECEIVE:  # posted first, so every send finds its receive waiting
            buffer = torch.empty(op.region.lengths, dtype=op.piece.tensor.dtype)
            work = group.irecv(buffer, peer, transfer)
            received.append((op, buffer, work))
    reading = {id(op): role for op, role in zip(ops, roles) if role[0] == READ}
    sends = []
    for op in reader.read_each([op for op in ops if id(op) in reading], threads):
        _, transfer, receivers = reading[id(op)]
        if receivers:
            data = _region(op).contiguous()
            sends += [group.isend(data, r, transfer) for r in receivers]
    for op, buffer, work in received:
        work.wait()
        _region(op).copy_(buffer)
    for work in sends:
        work.wait()
    return sum(buffer.numel() * buffer.element_size() for _, buffer, _ in received)


def _region(op: ReadOp) -> torch.Tensor:
    """The destination's view of the op's region."""
    return op.piece.tensor[op.region.relative_to(op.piece.box).slices()]
