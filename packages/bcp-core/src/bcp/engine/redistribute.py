"""Executing a read-once plan: this rank reads its share of the regions, sends each shared region
to the ranks that need it as soon as it is read, and receives the regions other ranks read."""

from __future__ import annotations

from typing import Any

import torch

from bcp.engine.reader import ShardReader
from bcp.layout.read_op import ReadOp, ReadRole


def read_and_share(reader: ShardReader, ops: list[ReadOp], roles: list[ReadRole], group: Any,
                   threads: int) -> int:
    """Run ``ops`` under ``roles`` (one per op) over the coordinator's group (``process_group()``,
    with ``isend``/``irecv`` to member indices); returns the bytes received from other ranks."""
    received: list[tuple[ReadOp, torch.Tensor, Any]] = []
    for op, role in zip(ops, roles):
        if not role.reads:  # posted first, so every send finds its receive waiting
            buffer = torch.empty(op.region.lengths, dtype=op.piece.tensor.dtype)
            work = group.irecv(buffer, role.peers[0], role.transfer)
            received.append((op, buffer, work))
    reading = {id(op): role for op, role in zip(ops, roles) if role.reads}
    sends = []
    for op in reader.read_each([op for op in ops if id(op) in reading], threads):
        role = reading[id(op)]
        if role.peers:
            data = _region(op).contiguous()
            sends += [group.isend(data, r, role.transfer) for r in role.peers]
    for op, buffer, work in received:
        work.wait()
        _region(op).copy_(buffer)
    for work in sends:
        work.wait()
    return sum(buffer.numel() * buffer.element_size() for _, buffer, _ in received)


def _region(op: ReadOp) -> torch.Tensor:
    """The destination's view of the op's region."""
    return op.piece.tensor[op.region.relative_to(op.piece.box).slices()]
