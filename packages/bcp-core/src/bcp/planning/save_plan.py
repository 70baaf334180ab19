"""Save planning: local plans (what each rank holds) -> a global plan (who writes what).

Replicated data is written once: identical boxes of a tensor on several ranks are replicas, and
each is given to the replica-holding rank with the fewest bytes so far, largest first (worst-fit,
paper section 4.1); a very large replicated box is cut along its first dimension so that several
of its holders write a part each. The coordinator also checks that ranks agree on every tensor's
dtype and global shape and that the pieces cover every tensor exactly. All of it is linear in the
number of pieces, except the pairwise overlap check, which is bounded per tensor.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import defaultdict
from typing import Any

import msgpack

from bcp.errors import MismatchError
from bcp.layout.box import Box
from bcp.layout.dtypes import dtype_from_name, dtype_name, itemsize
from bcp.planning.pieces import Piece

# Coverage is proven by volume plus pairwise disjointness; beyond this many distinct boxes per
# tensor the pairwise test is skipped (volume and bounds are still checked).
PAIRWISE_OVERLAP_LIMIT = 256
# A replicated box larger than this is split between the ranks that hold it.
SPLIT_BYTES = 256 << 20


def local_plan(tensors: list[tuple[str, Any, tuple[int, ...]]], pieces: list[Piece],
               replica_crcs: list[int] | None) -> list[Any]:
    """This rank's plan as plain data: ``[tensor rows, piece rows]``.

    Tensor rows ``[name, dtype, global shape]`` declare every tensor this rank has, pieces or not
    (an empty shard still names its tensor); piece rows ``[tensor row, offsets, lengths(, crc)]``
    refer to them, the crc of the piece's bytes only for the replica check."""
    index = {name: i for i, (name, _, _) in enumerate(tensors)}
    rows = []
    for i, p in enumerate(pieces):
        row = [index[p.name], list(p.box.offsets), list(p.box.lengths)]
        if replica_crcs is not None:
            row.append(replica_crcs[i])
        rows.append(row)
    return [[[n, dtype_name(d), list(s)] for n, d, s in tensors], rows]


def plan_digest(plan: list[Any]) -> bytes:
    """A fingerprint of a local plan: equal digests mean the same tensors, shapes, dtypes and boxes."""
    return hashlib.blake2b(msgpack.packb(plan), digest_size=16).digest()


def global_plan(local_plans: list[list[Any]], split_bytes: int | None = None) -> list[list[Any]]:
    """For each rank, the pieces it writes: a piece index, or ``[index, offsets, lengths]`` for the
    part of a split replicated piece (boxes over ``split_bytes``, default ``SPLIT_BYTES``)."""
    split_bytes = split_bytes or SPLIT_BYTES
    tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}
    replicas: dict[tuple[str, tuple, tuple], list[tuple[int, int]]] = defaultdict(list)
    crcs: dict[tuple[str, tuple, tuple], dict[int, int]] = defaultdict(dict)
    for rank, (declared, rows) in enumerate(local_plans):
        for name, dtype, shape in declared:
            seen = tensors.setdefault(name, (dtype, tuple(shape), rank))
            if seen[:2] != (dtype, tuple(shape)):
                raise MismatchError(
                    f"ranks disagree on the tensor: rank {seen[2]} has {seen[0]} {list(seen[1])}, "
                    f"rank {rank} has {dtype} {list(shape)}", key=name)
        for index, row in enumerate(rows):
            key = (declared[row[0]][0], tuple(row[1]), tuple(row[2]))
            replicas[key].append((rank, index))
            if len(row) > 3:
                crcs[key][rank] = row[3]

    _check_replicas_agree(crcs)
    _check_coverage(tensors, replicas)

    load = [0] * len(local_plans)
    writes: list[list[Any]] = [[] for _ in local_plans]
    sized = sorted(((math.prod(k[2]) * itemsize_of(tensors[k[0]][0]), k, h) for k, h in replicas.items()),
                   key=lambda item: -item[0])
    for nbytes, (_, offsets, lengths), holders in sized:
        parts = min(len(holders), -(-nbytes // split_bytes), lengths[0] if lengths else 1)
        if parts <= 1:
            rank, index = min(holders, key=lambda h: load[h[0]])
            load[rank] += nbytes
            writes[rank].append(index)
            continue
        chosen = sorted(holders, key=lambda h: load[h[0]])[:parts]
        for (rank, index), (start, count) in zip(chosen, _split_rows(lengths[0], parts)):
            sub = [offsets[0] + start, *offsets[1:]], [count, *lengths[1:]]
            load[rank] += nbytes * count // lengths[0]
            writes[rank].append([index, *sub])
    return writes


def _split_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(rows, parts)
    bounds, start = [], 0
    for i in range(parts):
        count = base + (1 if i < extra else 0)
        bounds.append((start, count))
        start += count
    return bounds


@functools.lru_cache(maxsize=None)
def itemsize_of(name: str) -> int:
    return itemsize(dtype_from_name(name))


def _check_replicas_agree(crcs: dict[tuple, dict[int, int]]) -> None:
    for (name, offsets, lengths), by_rank in crcs.items():
        if len(set(by_rank.values())) > 1:
            raise MismatchError(
                f"replicas of box offsets={list(offsets)} lengths={list(lengths)} differ between ranks "
                f"(checksums by rank: {by_rank})", key=name)


def _check_coverage(tensors: dict[str, tuple], replicas: dict[tuple, list]) -> None:
    boxes: dict[str, list[Box]] = defaultdict(list)
    for name, offsets, lengths in replicas:
        boxes[name].append(Box(offsets, lengths))
    for name, (_, shape, _) in tensors.items():
        found = boxes.get(name, [])
        total = math.prod(shape)
        covered = sum(b.numel for b in found)
        if covered != total:
            raise MismatchError(
                f"the ranks' pieces cover {covered} of the tensor's {total} elements "
                f"(global shape {list(shape)}); every element must be held by some rank", key=name)
        if len(found) <= PAIRWISE_OVERLAP_LIMIT:
            for i, a in enumerate(found):
                for b in found[i + 1:]:
                    if a.intersect(b) is not None:
                        raise MismatchError(f"pieces {a} and {b} overlap without being replicas", key=name)
