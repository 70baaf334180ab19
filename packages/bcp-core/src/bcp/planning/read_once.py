"""Read-once planning (paper section 4.1, Fig. 10): when several ranks need the same bytes of a
saved shard (data-parallel replicas loading the same parameters), one of them reads the bytes and
the others receive them over the process group, so storage serves each byte once."""

from __future__ import annotations

from collections import defaultdict
from bcp.layout.read_op import ReadRequest, ReadRole


def assign_readers(requests: list[list[ReadRequest]]) -> list[list[ReadRole]]:
    """For each rank, the role of each of its read requests. Each distinct region goes to the
    requesting rank with the fewest bytes to read so far, largest first."""
    holders: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    sizes: dict[tuple, int] = {}
    for rank, rows in enumerate(requests):
        for position, request in enumerate(rows):
            holders[request.key].append((rank, position))
            sizes[request.key] = request.nbytes
    load = [0] * len(requests)
    alone = ReadRole(True, -1, ())
    roles: list[list[ReadRole]] = [[alone] * len(rows) for rows in requests]
    transfer = 0
    for key in sorted(holders, key=lambda k: (-sizes[k], k)):
        group = holders[key]
        reader, position = min(group, key=lambda h: load[h[0]])
        load[reader] += sizes[key]
        if len(group) == 1:
            continue
        receivers = [h for h in group if h[0] != reader]
        roles[reader][position] = ReadRole(True, transfer, tuple(sorted({r for r, _ in receivers})))
        for rank, pos in receivers:
            roles[rank][pos] = ReadRole(False, transfer, (reader,)) if rank != reader else alone
        transfer += 1
    return roles
