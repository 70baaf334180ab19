"""The rest of a resumed epoch, delivered through a live loader, then the loader's own order again.

A loader resumed on another number of ranks (or whose sampler now walks another order: a single
device after distributed training) cannot reach its share of the saved epoch by skipping batches of
its own sampler. :class:`ResumedEpoch` stands in for the sampler inside the loader's batch sampler
(``loader.batch_sampler.sampler``, a public attribute of torch's and torchdata's batch samplers) for
the rest of that epoch: it yields the dataset indices :func:`bcp.adapters.epoch_walks.resumed_walk`
dealt to this rank, which the batch sampler cuts into batches (the last one short where the share is
not whole), and from the next epoch on it hands every iteration to the original sampler.

The next epoch is recognised by ``set_epoch`` with another epoch (Lightning's and Accelerate's loops
call it on ``batch_sampler.sampler`` at every epoch start) or, where the original sampler keeps an
``epoch`` of its own (torch's ``DistributedSampler``), by that epoch changing. Every iteration within
the resumed epoch walks the share from its start, as torch's samplers walk an epoch from its start,
so a loader may build iterators it drops (torchdata does while it restores) without losing samples.
Its length is the original sampler's, so the loader's and the trainer's count of an epoch's batches
stay those of a whole epoch; the trainer's count of batches done is moved by the integration.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import Sampler

from bcp.adapters.epoch_walks import Walk
from bcp.errors import CheckpointError


class ResumedEpoch(Sampler[int]):
    """``indices`` (this rank's ``walk`` of the epoch ``epoch``'s order) for the rest of that epoch,
    then ``original``'s. ``record`` is the saved position's description of the order (its spec, length,
    batch size), kept so that a save within the resumed epoch can say where this rank stands."""

    def __init__(self, original: Any, indices: list[int], walk: Walk, record: dict[str, Any],
                 epoch: int | None) -> None:
        self.original, self.indices, self.walk, self.record, self.epoch = original, indices, walk, record, epoch
        self.active = True
        self._original_epoch = getattr(original, "epoch", None)

    def __iter__(self) -> Iterator[int]:
        if self.active and getattr(self.original, "epoch", None) != self._original_epoch:
            self.active = False
        return iter(self.indices) if self.active else iter(self.original)

    def __len__(self) -> int:
        return len(self.original)

    def set_epoch(self, epoch: int) -> None:
        if self.active and self.epoch is not None and epoch != self.epoch:
            self.active = False
        set_epoch = getattr(self.original, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self._original_epoch = getattr(self.original, "epoch", None)

    def __getattr__(self, name: str) -> Any:
        # what else a trainer reads off the loader's sampler (a generator, num_replicas...)
        if name == "original":
            raise AttributeError(name)
        return getattr(self.original, name)


def install(loader: Any, indices: list[int], walk: Walk, record: dict[str, Any], epoch: int | None) -> ResumedEpoch:
    """Make ``loader`` deliver ``indices`` for the rest of the epoch (its batch sampler's sampler is
    replaced; a resumed epoch already installed is replaced by the new one)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is None or not hasattr(batch_sampler, "sampler"):
        raise CheckpointError(f"a {type(loader).__name__} without a batch sampler over a sampler (batch_size=): bcp "
                              "cannot deal it the rest of a resumed epoch", key="dataloader")
    original = batch_sampler.sampler
    if isinstance(original, ResumedEpoch):
        original = original.original
    batch_sampler.sampler = ResumedEpoch(original, indices, walk, record, epoch)
    return batch_sampler.sampler


def resumed(loader: Any) -> ResumedEpoch | None:
    """The resumed epoch ``loader`` is delivering now, or None (none installed, or its epoch is over)."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if not isinstance(sampler, ResumedEpoch) or not sampler.active:
        return None
    return sampler if getattr(sampler.original, "epoch", None) == sampler._original_epoch else None


def original_of(sampler: Any) -> Any:
    """The sampler a resumed epoch stands in for (``sampler`` itself where it is none)."""
    return sampler.original if isinstance(sampler, ResumedEpoch) else sampler
