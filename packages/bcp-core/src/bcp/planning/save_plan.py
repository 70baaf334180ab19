"""Save planning: local plans (what each rank holds) -> a global plan (who writes what).

Replicated data is written once: identical boxes of a tensor on several ranks are replicas, and
each is given to the replica-holding rank with the fewest bytes so far, largest first (worst-fit,
paper section 4.1). The coordinator also checks that ranks agree on every tensor's dtype and
global shape and that the pieces cover every tensor exactly. All of it is linear in the number
of pieces.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from bcp.errors import MismatchError
from bcp.layout.box import Box
from bcp.layout.dtypes import dtype_from_name, dtype_name, itemsize
from bcp.planning.pieces import Piece

# Coverage is proven by volume plus pairwise disjointness; beyond this many distinct boxes per
# tensor the pairwise test is skipped (volume and bounds are still checked).
PAIRWISE_OVERLAP_LIMIT = 256


@dataclass(frozen=True, slots=True)
class LocalObject:
    name: str
    crc: int
    nbytes: int


def local_plan(tensors: list[tuple[str, Any, tuple[int, ...]]], pieces: list[Piece],
               objects: list[LocalObject], replica_crcs: list[int] | None, used_pickle: bool) -> list[Any]:
    """This rank's plan as plain data: ``[tensor rows, piece rows, object rows, used_pickle]``.

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
    return [[[n, dtype_name(d), list(s)] for n, d, s in tensors], rows,
            [[o.name, o.crc, o.nbytes] for o in objects], used_pickle]


def global_plan(local_plans: list[list[Any]]) -> tuple[list[list[Any]], dict[str, dict[int, int]]]:
    """For each rank ``[piece indices to write, object names to write]``, and the object owners:
    for each object name and rank, the rank whose record stands for that rank's value."""
    tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}
    replicas: dict[tuple[str, tuple, tuple], list[tuple[int, int]]] = defaultdict(list)
    crcs: dict[tuple[str, tuple, tuple], dict[int, int]] = defaultdict(dict)
    for rank, (declared, rows, _, _) in enumerate(local_plans):
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
    writes: list[list[int]] = [[] for _ in local_plans]
    sized = sorted(replicas.items(), key=lambda kv: -math.prod(kv[0][2]) * itemsize_of(tensors[kv[0][0]][0]))
    for (name, _, lengths), holders in sized:
        rank, index = min(holders, key=lambda h: load[h[0]])
        load[rank] += math.prod(lengths) * itemsize_of(tensors[name][0])
        writes[rank].append(index)

    owners = _object_owners(local_plans, load)
    object_writes: list[list[str]] = [[] for _ in local_plans]
    for name, by_rank in owners.items():
        for owner in set(by_rank.values()):
            object_writes[owner].append(name)
    return [[writes[r], object_writes[r]] for r in range(len(local_plans))], owners


@functools.lru_cache(maxsize=None)
def itemsize_of(name: str) -> int:
    return itemsize(dtype_from_name(name))


def _object_owners(local_plans: list[list[Any]], load: list[int]) -> dict[str, dict[int, int]]:
    """For each object name and rank, the rank whose record stands for it: ranks whose encoded
    bytes are identical (same crc and size) share one record, written by the least loaded of them."""
    groups: dict[str, dict[tuple[int, int], list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank, plan in enumerate(local_plans):
        for name, crc, nbytes in plan[2]:
            groups[name][(crc, nbytes)].append(rank)
    owners: dict[str, dict[int, int]] = {}
    for name, variants in groups.items():
        owners[name] = {}
        for (_, nbytes), ranks in variants.items():
            owner = min(ranks, key=lambda r: load[r])
            load[owner] += nbytes
            owners[name].update({r: owner for r in ranks})
    return owners


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
