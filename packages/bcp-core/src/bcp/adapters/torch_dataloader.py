"""A torch ``DataLoader``'s position as what the trainer consumed, resharded across DP sizes.

A loader with read workers asks its sampler for ``num_workers x prefetch_factor`` batches ahead of
the trainer, so the sampler's own count is not where the trainer stands. For a map-style dataset
batched by the loader's ``BatchSampler`` and delivered in order, the trainer's position is the
number of batches the loader's iterator has yielded: batch ``b`` of an epoch holds positions
``[b x batch_size, (b + 1) x batch_size)`` of the rank's sampler order. This module saves that
position (a :class:`bcp.ShardedDataloader`: the epoch's order as the replicated part, each rank's
consumed count as its part), for two samplers whose global order is a pure function of their
settings and epoch:

- ``bcp.ResumableDistributedSampler``: any DP change continues the global order exactly (the
  sampler's own resharding, given the consumed counts instead of the handed-out ones);
- torch's ``DistributedSampler`` (under a torchdata ``StatefulDataLoader``): each rank's part is its
  position in the epoch's order (``bcp.adapters.epoch_positions``); a resume, on any DP size, deals
  the samples not yet consumed to the new ranks and the loader delivers this rank's share for the
  rest of the epoch (``bcp.adapters.resumed_epoch``), then its sampler's order again.

Anything else (another sampler, an iterable dataset, a custom batch sampler) is not handled here.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from bcp.adapters import epoch_order
from bcp.torch_internals import dataloader as loader_internals
from bcp.adapters.distributed_sampler import ResumableDistributedSampler, loaders_own_batch_sampler
from bcp.adapters.epoch_positions import deliver, natural_walk, plan, position
from bcp.adapters.epoch_walks import Walk
from bcp.errors import CheckpointError, MismatchError

if TYPE_CHECKING:  # the dataloader module builds on this one
    from bcp.adapters.part_key import PartKey

_KEY = "dataloader"
#: The replicated part's ``sampler`` field.
_BCP, _TORCH = "bcp.ResumableDistributedSampler", "torch.DistributedSampler"


def position_of(loader: Any) -> "LoaderPosition | None":
    """The position adapter for ``loader``, or None when it is not a DataLoader this module reads
    (the caller then treats it as an opaque ``state_dict``). Raises where the loader is one but its
    position cannot be known."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    # a DistributedSampler subclass may draw its order elsewhere (Lightning's wrapper of another sampler)
    if not (isinstance(loader.sampler, ResumableDistributedSampler) or type(loader.sampler) is DistributedSampler):
        return None
    if loader.batch_size is None or not loaders_own_batch_sampler(loader.batch_sampler) \
            or loader.batch_sampler.sampler is not loader.sampler:
        raise CheckpointError(f"a {type(loader).__name__} with a custom batch sampler: bcp cannot tell which samples "
                              "its batches held; batch with batch_size= and the sampler", key=_KEY)
    if isinstance(loader.sampler, DistributedSampler) and not callable(getattr(loader, "load_state_dict", None)):
        raise CheckpointError("a torch DataLoader with torch's DistributedSampler keeps no position bcp can read or "
                              "restore (the sampler counts nothing and cannot start mid-epoch); use torchdata's "
                              "StatefulDataLoader or bcp.ResumableDistributedSampler", key=_KEY)
    if not getattr(loader, "in_order", True):
        raise CheckpointError(f"a {type(loader).__name__} with in_order=False delivers batches out of order: "
                              "what the trainer consumed is not a prefix of the sampler's order", key=_KEY)
    return LoaderPosition(loader)


def why_opaque(loader: Any) -> str:
    """Why bcp reads no position out of a loader it saves as an opaque ``state_dict``."""
    if not isinstance(loader, DataLoader):
        return f"a {type(loader).__name__} is not a torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return ("its iterable dataset's read workers hold their positions within the old ranks' shards of the stream, "
                "and the dataset does not implement bcp.ReshardableIterableDataset")
    return (f"its sampler is a {type(loader.sampler).__name__}: bcp reads the position of a map-style dataset's "
            "loader whose sampler is bcp.ResumableDistributedSampler or torch's DistributedSampler")


#: The last iterator each followed plain DataLoader made (None: none yet). Kept as StatefulDataLoader
#: and persistent workers keep theirs, so its count outlives the trainer's loop over it.
_LAST_ITERATORS: "weakref.WeakKeyDictionary[DataLoader, Any]" = weakref.WeakKeyDictionary()


def _follow(loader: DataLoader) -> None:
    """Keep the iterators a plain DataLoader makes from now on, so the batches yielded can be read."""
    if loader in _LAST_ITERATORS:
        return
    _LAST_ITERATORS[loader] = None
    loader_internals.on_new_iterator(loader, lambda iterator: _LAST_ITERATORS.__setitem__(loader, iterator))


class LoaderPosition:
    """A DataLoader as a :class:`bcp.ShardedDataloader`: its sampler's epoch order and how many
    samples of it this rank's trainer has consumed."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader, self.sampler, self.batch_size = loader, loader.sampler, loader.batch_size
        self._stateful = callable(getattr(loader, "load_state_dict", None))
        if not self._stateful and loader.num_workers > 0 and not loader.persistent_workers:
            _follow(loader)

    # -- what the trainer consumed -------------------------------------------------------------

    def _batches(self) -> int | None:
        """The batches the loader's current iterator has yielded to the trainer, or None when it has
        no iterator bcp can see and nothing reads ahead. Raises where one read ahead unseen."""
        current = loader_internals.current_iterator(self.loader)
        if self._stateful:
            pending = loader_internals.pending_state(self.loader)  # loaded, not yet iterated
            if current is None:
                return loader_internals.state_batches_yielded(pending) if pending else None
            return loader_internals.batches_yielded(current)
        if self.loader.num_workers == 0:
            return None  # nothing reads ahead: the sampler's count is the trainer's
        iterator = current if self.loader.persistent_workers else _LAST_ITERATORS.get(self.loader)
        if iterator is None and self._handed_out():
            raise CheckpointError(
                f"a DataLoader with {self.loader.num_workers} read workers was iterated before bcp could follow it: "
                "its workers read ahead of the trainer, so the sampler's count is not what the trainer consumed. "
                "Build the DataloaderState before iterating, or use persistent_workers=True or torchdata's "
                "StatefulDataLoader", key=_KEY)
        return None if iterator is None else loader_internals.batches_yielded(iterator)

    def _handed_out(self) -> bool:
        sampler = self.sampler
        return isinstance(sampler, ResumableDistributedSampler) and sampler.taken != sampler.resume_at

    def consumed(self) -> int:
        """Samples of bcp's sampler's epoch order the trainer has consumed, counted from the position
        the epoch resumed at, as its ``taken``."""
        batches = self._batches()
        if batches is None:
            return self.sampler.taken
        return min(self.sampler.resume_at + batches * self.batch_size, self.sampler.taken)

    # -- the ShardedDataloader protocol ----------------------------------------------------------

    def replicated_state(self) -> dict[str, Any]:
        if isinstance(self.sampler, ResumableDistributedSampler):
            return {"sampler": _BCP, "batch_size": self.batch_size, **self.sampler.replicated_state()}
        s = self.sampler
        return {"sampler": _TORCH, "batch_size": self.batch_size, "size": len(s.dataset), "shuffle": s.shuffle,
                "seed": s.seed, "drop_last": s.drop_last, "epoch": s.epoch}

    def sharded_states(self) -> list[dict[str, Any]]:
        if isinstance(self.sampler, ResumableDistributedSampler):
            return [{"taken": self.consumed()}]
        return [{"position": self._position()}]

    def _position(self) -> dict[str, Any]:
        """Where this rank stands in the epoch's order (the resumed share it walks, after a resume)."""
        batches = self._batches() or 0
        walk = natural_walk(self.sampler)
        finished = self._stateful and loader_internals.finished(self.loader)
        return position(self.loader, epoch_order.distributed(self.sampler), walk,
                        consumed=batches * self.batch_size, finished=finished, epoch=self.sampler.epoch,
                        batch_size=self.batch_size, batch_drop_last=self.loader.drop_last, drop=self._drops(),
                        generator=None)

    def _drops(self) -> bool:
        return bool(self.loader.drop_last or self.sampler.drop_last)

    @staticmethod
    def assign_parts(saved: list[PartKey], dp_size: int) -> list[list[PartKey]]:
        """Every rank reads every rank's count: the global position needs them all (they are tiny)."""
        return [list(saved) for _ in range(dp_size)]

    def load_dataloader_state(self, replicated: Any, sharded: list[Any]) -> None:
        kind = replicated.get("sampler")
        live = _BCP if isinstance(self.sampler, ResumableDistributedSampler) else _TORCH
        if kind != live:
            raise MismatchError(f"the loader's position was saved for a {kind} and the live loader's sampler is a "
                                f"{type(self.sampler).__name__}", key=f"{_KEY}/replicated")
        if replicated["batch_size"] != self.batch_size:
            raise MismatchError(f"the loader was saved with batch_size {replicated['batch_size']}, the live one has "
                                f"{self.batch_size}", key=f"{_KEY}/replicated")
        if kind == _BCP:
            self.sampler.load_dataloader_state(replicated, sharded)
            self._restart()
        else:
            self._load_distributed_sampler(replicated, sharded)

    def _restart(self) -> None:
        """Make the loader's next iterator start from the sampler's position (dropping any batches its
        workers had read ahead)."""
        if self._stateful:
            self.loader.load_state_dict({})
        elif self.loader.persistent_workers:
            loader_internals.drop_iterator(self.loader)

    def _load_distributed_sampler(self, replicated: dict[str, Any], sharded: list[dict[str, Any]]) -> None:
        """Deal the rest of the saved epoch to this rank (its own batches again on the same DP size)."""
        s = self.sampler
        live = {"size": len(s.dataset), "shuffle": s.shuffle, "seed": s.seed, "drop_last": s.drop_last}
        saved = {k: replicated[k] for k in live}
        if saved != live:
            raise MismatchError(f"the DistributedSampler was saved with {saved}, the live one has {live}",
                                key=f"{_KEY}/replicated")
        positions = [part["position"] if "position" in part else _position_of_count(replicated, len(sharded), rank,
                                                                                     int(part["taken"]))
                     for rank, part in enumerate(sharded)]
        resume = plan(positions, s.num_replicas, s.rank, batch_size=self.batch_size,
                      batch_drop_last=self.loader.drop_last, drop=self._drops())
        s.set_epoch(resume.next_epoch())
        self._restart()
        deliver(self.loader, resume, None, record=positions[0])


def _position_of_count(replicated: dict[str, Any], world: int, rank: int, taken: int) -> dict[str, Any]:
    """The position of a rank saved as the samples it had consumed (``{"taken": n}``, as bcp saved it
    before positions)."""
    size, drop_last = int(replicated["size"]), bool(replicated["drop_last"])
    per_rank = size // world if drop_last else -(-size // world)
    order = epoch_order.permutation(size, replicated["seed"] + replicated["epoch"]) if replicated["shuffle"] \
        else epoch_order.sequence(size)
    walk = Walk(world, rank, 0, per_rank)
    return {"order": order, "length": size, "epoch": int(replicated["epoch"]), "walk": walk.record(taken),
            "finished": taken >= per_rank, "generator": None}
