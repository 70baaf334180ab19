"""Per-rank values that several ranks hold with identical bytes are written once.

Every rank sends an 8-byte digest of each of its encoded values with its word on the plan (the
exchange every save makes anyway); from every rank's digests each rank works out the same answer:
of the ranks whose value ``name`` has one digest, the lowest writes one record standing for all of
them (``ValueWrite.ranks``), the others write nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from bcp.layout.write_plan import ValueWrite


def digests(values: list[ValueWrite]) -> list[list]:
    """``[name, digest]`` of each value, for the plan exchange."""
    return [[v.name, _digest(v)] for v in values]


def values_to_write(rank: int, values: list[ValueWrite], every_rank: list[list[list]]) -> list[ValueWrite]:
    """This rank's values to write, given every rank's :func:`digests`."""
    holders: dict[tuple[str, int], list[int]] = {}
    for r, pairs in enumerate(every_rank):
        for name, digest in pairs:
            holders.setdefault((name, digest), []).append(r)
    writes = []
    for value in values:
        ranks = holders.get((value.name, _digest(value)), [rank])
        if len(ranks) == 1:
            writes.append(value)
        elif ranks[0] == rank:
            writes.append(replace(value, ranks=tuple(ranks)))
    return writes


def _digest(value: ValueWrite) -> int:
    h = hashlib.blake2b(value.data, digest_size=8)
    h.update(bytes([value.used_pickle]) + value.tree_nbytes.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "big")
