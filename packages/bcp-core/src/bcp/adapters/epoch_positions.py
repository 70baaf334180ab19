"""Where a rank's loader stands in its epoch (a *position*, saved per rank) and how a rank of another
number continues the epoch from every saved rank's position (a :class:`Resume`).

A position is a value of bcp's safe encoding::

    {"order": spec, "length": n, "epoch": e, "walk": {world, rank, first, end, unit, done},
     "finished": bool, "batch_size": B, "batch_drop_last": bool, "drop": bool, "generator": bytes | None}

``order`` and ``length`` say which order the epoch walks (``bcp.adapters.epoch_order``), ``walk``
which class of it this rank walks and how far it got, ``generator`` where the generator of the
sampler that drew the order stands now (so a resume from the end of the epoch draws the next epoch's
order as the uninterrupted run does). Integrations build positions from their live loaders
(:func:`position`) and turn every saved rank's into this rank's :class:`Resume` (:func:`plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from bcp.adapters import epoch_order
from bcp.adapters.distributed_sampler import ResumableDistributedSampler
from bcp.adapters.epoch_walks import Walk, batch_count, consumed_prefix, resumed_walk
from bcp.adapters.resumed_epoch import install, resumed
from bcp.errors import MismatchError

_KEY = "dataloader"


def natural_walk(sampler: Any) -> Walk:
    """The walk a sampler takes through its epoch's order from the epoch's start: a
    ``DistributedSampler``'s class (padded to or cut at its ``num_samples``), bcp's sampler's class,
    else all of it."""
    if isinstance(sampler, DistributedSampler):
        return Walk(sampler.num_replicas, sampler.rank, 0, sampler.num_samples)
    if isinstance(sampler, ResumableDistributedSampler):
        return Walk(sampler.dp_size, sampler.dp_rank, 0, len(sampler))
    return Walk(1, 0, 0, len(sampler))


def position(loader: Any, order: dict[str, Any] | None, walk: Walk, *, consumed: int, finished: bool,
             epoch: int | None, batch_size: int, batch_drop_last: bool, drop: bool,
             generator: torch.Generator | None, current: Any = None) -> dict[str, Any] | None:
    """This rank's position: ``walk`` of ``order`` with ``consumed`` units of it done (the trainer's
    count, not what read workers fetched ahead), or, within a resumed epoch (``current``, or the
    :class:`ResumedEpoch` ``loader`` delivers), that epoch's share with ``consumed`` samples of it
    done. None where the order is unknown to bcp."""
    current = current if current is not None else resumed(loader)
    if current is not None:
        order, walk, epoch, length = current.record["order"], current.walk, current.epoch, current.record["length"]
    elif order is None:
        return None
    else:
        length = epoch_order.size(order)
    done = walk.end if finished else walk.first + consumed
    return {"order": order, "length": length, "epoch": epoch, "walk": walk.record(done),
            "finished": bool(finished or done >= walk.end), "batch_size": batch_size,
            "batch_drop_last": bool(batch_drop_last), "drop": bool(drop),
            "generator": None if generator is None else generator.get_state().numpy().tobytes()}


@dataclass
class Resume:
    """How this rank continues a saved epoch. ``finished``: the epoch was over; the loader starts the
    next one (``epoch + 1``) fresh. Otherwise ``walk`` of ``order`` is this rank's share of the rest,
    ``batches`` batches long (the same on every rank)."""

    order: dict[str, Any]
    length: int
    epoch: int | None
    finished: bool
    walk: Walk | None
    batches: int
    generator: bytes | None

    def next_epoch(self) -> int | None:
        """The epoch the loader's sampler walks first after the resume."""
        return None if self.epoch is None else self.epoch + int(self.finished)


def plan(positions: list[dict[str, Any]], world: int, rank: int, *, batch_size: int, batch_drop_last: bool,
         drop: bool, lockstep: bool = True) -> Resume:
    """Rank ``rank`` of ``world``'s share of the rest of the epoch every saved rank's ``positions``
    (in rank order) describe; refused where they are not one epoch of one order, or where what they
    consumed is no prefix of it."""
    first = positions[0]
    for other in positions[1:]:
        if not epoch_order.same(other["order"], first["order"]) or other["epoch"] != first["epoch"] \
                or other["length"] != first["length"]:
            raise MismatchError("the saved ranks' loaders walked different orders (another seed, epoch or draw on "
                                "each rank), so there is no one epoch to continue on another number of ranks",
                                key=_KEY)
    length = int(first["length"])
    finished = all(p["finished"] for p in positions)
    common = dict(order=first["order"], length=length, epoch=first["epoch"], generator=first["generator"])
    if not finished and len(positions) == world and all(p["walk"]["world"] == world for p in positions):
        # the same ranks: each continues its own walk, whatever the others consumed
        walk = Walk.of(positions[rank]["walk"])
        walk = Walk(walk.world, walk.rank, int(positions[rank]["walk"]["done"]), walk.end, walk.unit)
        if walk.unit == 1:
            return Resume(finished=False, walk=walk, batches=batch_count(walk.count(), batch_size, batch_drop_last),
                          **common)
    prefix = length if finished else consumed_prefix([p["walk"] for p in positions], length)
    if prefix >= length:
        return Resume(finished=True, walk=None, batches=0, **common)
    walk = resumed_walk(prefix, length, world, rank, batch_size, drop=drop, batch_drop_last=batch_drop_last,
                        even=lockstep)
    return Resume(finished=False, walk=walk, batches=batch_count(walk.count(), batch_size, batch_drop_last), **common)


def deliver(loader: Any, resume: Resume, drawing_sampler: Any, *, record: dict[str, Any]) -> None:
    """Make ``loader`` deliver this rank's share of the rest of the epoch (``record``: the position's
    description of the order, kept for a save within it). A finished epoch installs nothing; the
    drawing sampler's generator is set to where the saved one stood, so the next draw is the
    uninterrupted run's."""
    if resume.finished:
        restore_generator(drawing_sampler, resume.generator)
        return
    indices = resume.walk.indices(epoch_order.rebuild(resume.order, drawing_sampler), resume.length)
    install(loader, indices, resume.walk, record, resume.epoch)


def restore_generator(sampler: Any, state: bytes | None) -> None:
    """Set a drawing sampler's generator to a saved state (nothing where either is missing)."""
    if state is not None and sampler is not None:
        if getattr(sampler, "generator", None) is None:
            sampler.generator = torch.Generator()
        sampler.generator.set_state(epoch_order.generator_state(state))
