"""Per-rank values that several ranks hold with identical bytes are written once.

Every rank sends an 8-byte digest of each of its encoded values with its word on the plan (the
exchange every save makes anyway); from every rank's digests each rank works out the same answer:
of the ranks whose value ``name`` has one digest, the lowest writes one record standing for all of
them (``ValueWrite.ranks``), the others write nothing. A digest is folded from the record's chunk
checksums (``encoded_value``), which the writer then stores: one pass over the record's bytes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bcp.engine.checksum import content_digest, joined_chunk_crcs
from bcp.layout.values import encode_value
from bcp.layout.write_plan import ValueWrite


def encoded_value(name: str, value: Any, *, allow_pickle: bool, chunk: int,
                  extract: Any = None) -> ValueWrite:
    """``value``'s record with its chunk checksums and digest (``layout.values.encode_value``)."""
    encoded = encode_value(value, key=name, allow_pickle=allow_pickle, extract=extract)
    parts = encoded.chunks()
    crcs = joined_chunk_crcs(parts, chunk)
    return ValueWrite.of(name, encoded, tuple(crcs), content_digest(crcs, len(encoded.tree), encoded.used_pickle))


def digests(values: list[ValueWrite]) -> list[list]:
    """``[name, digest]`` of each value, for the plan exchange."""
    return [[v.name, v.digest] for v in values]


def values_to_write(rank: int, values: list[ValueWrite], every_rank: list[list[list]]) -> list[ValueWrite]:
    """This rank's values to write, given every rank's :func:`digests`."""
    holders: dict[tuple[str, int], list[int]] = {}
    for r, pairs in enumerate(every_rank):
        for name, digest in pairs:
            holders.setdefault((name, digest), []).append(r)
    writes = []
    for value in values:
        ranks = holders.get((value.name, value.digest), [rank])
        if len(ranks) == 1:
            writes.append(value)
        elif ranks[0] == rank:
            writes.append(replace(value, ranks=tuple(ranks)))
    return writes
