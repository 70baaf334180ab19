"""Read-once planning (paper section 4.1, Fig. 10): when several ranks need the same bytes of a
saved shard (data-parallel replicas loading the same parameters), one of them reads the bytes and
the others receive them over the process group, so storage serves each byte once."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from bcp.planning.load_plan import ReadOp

READ = "read"
RECEIVE = "receive"


def read_requests(ops: list[ReadOp]) -> list[list[Any]]:
    """This rank's reads as plain data: ``[tensor, shard index, region offsets, region lengths, nbytes]``."""
    return [[op.piece.name, op.shard_index, list(op.region.offsets), list(op.region.lengths),
             op.region.numel * op.piece.tensor.element_size()] for op in ops]


def assign_readers(requests: list[list[list[Any]]]) -> list[list[list[Any]]]:
    """For each rank and each of its reads, its role: ``[READ, transfer id, [receiving ranks]]``
    or ``[RECEIVE, transfer id, reading rank]``. Each distinct region goes to the requesting rank
    with the fewest bytes to read so far, largest first; transfer ids number the shared regions in
    one order that every rank follows, so sends and receives match."""
    holders: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    sizes: dict[tuple, int] = {}
    for rank, rows in enumerate(requests):
        for position, (name, shard, offsets, lengths, nbytes) in enumerate(rows):
            key = (name, shard, tuple(offsets), tuple(lengths))
            holders[key].append((rank, position))
            sizes[key] = nbytes
    load = [0] * len(requests)
    roles: list[list[Any]] = [[None] * len(rows) for rows in requests]
    transfer = 0
    for key in sorted(holders, key=lambda k: (-sizes[k], k)):
        group = holders[key]
        reader, position = min(group, key=lambda h: load[h[0]])
        load[reader] += sizes[key]
        if len(group) == 1:
            roles[reader][position] = [READ, -1, []]
            continue
        receivers = [h for h in group if h[0] != reader]
        roles[reader][position] = [READ, transfer, sorted({r for r, _ in receivers})]
        for rank, pos in receivers:
            roles[rank][pos] = [RECEIVE, transfer, reader] if rank != reader else [READ, -1, []]
        transfer += 1
    return roles
