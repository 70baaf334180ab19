"""How data-parallel ranks walk an epoch's order, where they stood when it was saved, and how the rest
of the epoch is dealt to another number of ranks.

Rank ``r`` of ``D`` walks the positions ``r, r + D, r + 2D, ...`` of the order (its *class*), counted
in *units*: single positions (torch's ``DistributedSampler``, Lightning's) or batches of ``B``
positions (Accelerate deals batches). A :class:`Walk` is the class indices ``[first, end)`` a rank
walks; positions at or beyond the order's length wrap to its start (torch's padding of an uneven
split). A rank's *position* is the class indices it has done: ``first`` plus what its trainer consumed.

When every rank stepped in lockstep, the positions done by all ranks are a prefix of the order, and
the rest of the epoch is the order from there: :func:`consumed_prefix` finds it and
:func:`resumed_walk` deals it again, position by position, so that every sample not yet consumed is
delivered exactly once. Each new rank's share is a whole number of batches but the last, which may be
short; all ranks take the same number of batches (they step in lockstep): where the shares would
differ by a batch, the ranks short of one repeat samples of the epoch's start (as torch's sampler pads
an uneven split), or, with ``drop_last``, the ranks with one more drop their last samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bcp.errors import MismatchError

_KEY = "dataloader"


@dataclass(frozen=True)
class Walk:
    """Rank ``rank`` of ``world`` walks class indices ``[first, end)`` of an order, in ``unit`` positions."""

    world: int
    rank: int
    first: int
    end: int
    unit: int = 1

    def positions(self) -> range:
        """The unit positions the walk visits, in order."""
        return range(self.rank + self.first * self.world, self.rank + self.end * self.world, self.world)

    def count(self) -> int:
        return max(0, self.end - self.first)

    def indices(self, order: list[int], length: int) -> list[int]:
        """The dataset indices the walk delivers: each unit position's ``unit`` positions of ``order``
        (the last unit cut at ``length``), positions beyond ``length`` wrapped to the start."""
        out: list[int] = []
        for position in self.positions():
            start = position * self.unit
            stop = start + self.unit if start + self.unit <= length or start >= length else length
            out += [order[p % length] for p in range(start, stop)]
        return out

    def record(self, done: int) -> dict[str, int]:
        """What a save keeps of this walk: the rank's place and the class indices done."""
        return {"world": self.world, "rank": self.rank, "first": self.first, "end": self.end, "unit": self.unit,
                "done": min(max(done, self.first), self.end)}

    @staticmethod
    def of(record: dict[str, Any]) -> "Walk":
        return Walk(int(record["world"]), int(record["rank"]), int(record["first"]), int(record["end"]),
                    int(record.get("unit", 1)))


def class_size(length: int, world: int, rank: int) -> int:
    """How many positions below ``length`` rank ``rank`` of ``world`` has in its class."""
    return max(0, -(-(length - rank) // world))


def consumed_prefix(records: list[dict[str, Any]], length: int) -> int:
    """The positions (not units) of the order that the saved ranks had done, from each rank's record
    (in rank order). Raised where they are not a prefix of it: the ranks did not step in lockstep."""
    world, unit = int(records[0]["world"]), int(records[0].get("unit", 1))
    if len(records) != world or any(int(r["world"]) != world or int(r["rank"]) != i or int(r.get("unit", 1)) != unit
                                    for i, r in enumerate(records)):
        raise MismatchError(f"the saved dataloader positions do not describe ranks 0..{world - 1} of one walk",
                            key=_KEY)
    done = [int(r["done"]) for r in records]
    low = min(done)
    ahead = [i for i, d in enumerate(done) if d != low]
    if any(done[i] != low + 1 for i in ahead) or ahead != list(range(len(ahead))):
        raise MismatchError(f"the saved ranks had consumed {done} of their shares of the epoch: not the same "
                            "number of samples (training steps in lockstep), so what they consumed is no prefix of "
                            "the epoch's order and cannot be dealt to another number of ranks", key=_KEY)
    return min(length, (low * world + len(ahead)) * unit)


def resumed_walk(prefix: int, length: int, world: int, rank: int, batch_size: int, *,
                 drop: bool, batch_drop_last: bool, even: bool = True) -> Walk:
    """Rank ``rank``'s walk of the positions ``[prefix, length)`` dealt to ``world`` ranks (each its
    class of the order, from where the class passes ``prefix``). With ``even``, evened to one number
    of batches per rank: by extending the short ranks' walks past the end into the order's start
    (repeating samples) or, with ``drop``, by cutting the long ones."""
    firsts = [class_size(prefix, world, r) for r in range(world)]
    ends = [class_size(length, world, r) for r in range(world)]
    if not even:
        return Walk(world, rank, firsts[rank], ends[rank])
    batches = [batch_count(end - first, batch_size, batch_drop_last) for first, end in zip(firsts, ends)]
    target = min(batches) if drop else max(batches)
    end = ends[rank]
    while batch_count(end - firsts[rank], batch_size, batch_drop_last) > target:
        end -= 1
    while batch_count(end - firsts[rank], batch_size, batch_drop_last) < target:
        end += 1
    return Walk(world, rank, firsts[rank], end)


def batch_count(samples: int, batch_size: int, drop_last: bool) -> int:
    """How many batches a loader cuts ``samples`` samples into."""
    return samples // batch_size if drop_last else -(-samples // batch_size)
