"""Exact coverage of 1-D tensors, which Megatron does not check for irregular shards.

The distributed optimizer's ``dp_reshardable`` buckets are 1-D tensors cut into one piece per
parameter (and padding) on each data-parallel rank: thousands of pieces per bucket, beyond the
core's pairwise overlap test (volume alone can hide an overlap that matches a gap). On one axis,
sorting the distinct pieces proves exact coverage and names the first gap or overlap. The check
is collective; it gathers the pieces again only when some rank's 1-D pieces changed.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Any

import msgpack

from bcp import MismatchError
from bcp.integration import Coordinator, Outcome, all_agree, gather_then_reply

#: A rank's 1-D pieces: ``{tensor name: [size, [[offset, length], ...]]}``.
Spans = dict[str, list[Any]]


class OneDimCoverage:
    """Remembers the last structure it proved, per strategy instance."""

    def __init__(self) -> None:
        self._proven: bytes | None = None

    def check(self, coord: Coordinator, spans: Outcome) -> None:
        """Collective. ``spans`` is this rank's :data:`Spans` outcome (its failure is raised on
        every rank)."""
        what = "checking that the pieces of 1-D tensors cover them exactly"
        digest = hashlib.blake2b(msgpack.packb(spans.value), digest_size=16).digest() if spans.error is None else b""
        changed = all_agree(coord, Outcome(digest != self._proven, spans.error), what)
        if any(changed):
            gather_then_reply(coord, spans, _replies, what)
        self._proven = digest


def check_spans(every_rank: list[Spans]) -> None:
    """Every 1-D tensor must be covered exactly once by the distinct pieces of all ranks."""
    sizes: dict[str, int] = {}
    pieces: dict[str, set[tuple[int, int]]] = defaultdict(set)
    for spans in every_rank:
        for name, (size, parts) in spans.items():
            sizes[name] = size
            pieces[name].update((offset, length) for offset, length in parts if length)
    for name, size in sizes.items():
        end = 0
        for start, length in sorted(pieces[name]):
            if start > end:
                raise MismatchError(f"elements [{end}, {start}) of the tensor ({size} elements) are held by no rank",
                                    key=name)
            if start < end:
                raise MismatchError(f"pieces overlap at elements [{start}, {min(end, start + length)}) without being "
                                    "replicas (same offset and length)", key=name)
            end = start + length
        if end != size:
            raise MismatchError(f"elements [{end}, {size}) of the tensor are held by no rank", key=name)


def _replies(every_rank: list[Spans]) -> list[None]:
    check_spans(every_rank)
    return [None] * len(every_rank)
