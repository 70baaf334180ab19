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
- torch's ``DistributedSampler`` (under a torchdata ``StatefulDataLoader``): the new ranks skip
  ``consumed x D / D'`` samples of their own shard each, which is exact when that is a whole number
  of batches; otherwise refused, since the sampler cannot start anywhere else.

Anything else (another sampler, an iterable dataset, a custom batch sampler) is not handled here.
"""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from bcp.adapters.distributed_sampler import ResumableDistributedSampler, loaders_own_batch_sampler
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
    make = loader._get_iterator

    def get_iterator() -> Any:
        _LAST_ITERATORS[loader] = make()
        return _LAST_ITERATORS[loader]

    _LAST_ITERATORS[loader] = None
    loader._get_iterator = get_iterator  # DataLoader calls it for every new iterator


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
        if self._stateful:
            pending = getattr(self.loader, "next_iter_state", None)  # loaded, not yet iterated
            if self.loader._iterator is None:
                return batches_yielded(pending) if pending else None
            return self.loader._iterator._num_yielded
        if self.loader.num_workers == 0:
            return None  # nothing reads ahead: the sampler's count is the trainer's
        iterator = self.loader._iterator if self.loader.persistent_workers else _LAST_ITERATORS.get(self.loader)
        if iterator is None and self._handed_out():
            raise CheckpointError(
                f"a DataLoader with {self.loader.num_workers} read workers was iterated before bcp could follow it: "
                "its workers read ahead of the trainer, so the sampler's count is not what the trainer consumed. "
                "Build the DataloaderState before iterating, or use persistent_workers=True or torchdata's "
                "StatefulDataLoader", key=_KEY)
        return None if iterator is None else iterator._num_yielded

    def _handed_out(self) -> bool:
        sampler = self.sampler
        return isinstance(sampler, ResumableDistributedSampler) and sampler.taken != sampler.resume_at

    def consumed(self) -> int:
        """Samples of this rank's epoch order the trainer has consumed (for bcp's sampler, counted
        from the position the epoch resumed at, as its ``taken``)."""
        batches = self._batches()
        if isinstance(self.sampler, ResumableDistributedSampler):
            if batches is None:
                return self.sampler.taken
            return min(self.sampler.resume_at + batches * self.batch_size, self.sampler.taken)
        return 0 if batches is None else min(batches * self.batch_size, self.sampler.num_samples)

    # -- the ShardedDataloader protocol ----------------------------------------------------------

    def replicated_state(self) -> dict[str, Any]:
        if isinstance(self.sampler, ResumableDistributedSampler):
            return {"sampler": _BCP, "batch_size": self.batch_size, **self.sampler.replicated_state()}
        s = self.sampler
        return {"sampler": _TORCH, "batch_size": self.batch_size, "size": len(s.dataset), "shuffle": s.shuffle,
                "seed": s.seed, "drop_last": s.drop_last, "epoch": s.epoch}

    def sharded_states(self) -> list[dict[str, Any]]:
        return [{"taken": self.consumed()}]

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
            self._load_distributed_sampler(replicated, [int(part["taken"]) for part in sharded])

    def _restart(self) -> None:
        """Make the loader's next iterator start from the sampler's position (dropping any batches its
        workers had read ahead)."""
        if self._stateful:
            self.loader.load_state_dict({})
        elif self.loader.persistent_workers:
            self.loader._iterator = None

    def _load_distributed_sampler(self, replicated: dict[str, Any], taken: list[int]) -> None:
        s = self.sampler
        live = {"size": len(s.dataset), "shuffle": s.shuffle, "seed": s.seed, "drop_last": s.drop_last}
        saved = {k: replicated[k] for k in live}
        if saved != live:
            raise MismatchError(f"the DistributedSampler was saved with {saved}, the live one has {live}",
                                key=f"{_KEY}/replicated")
        dp_size, dp_rank = s.num_replicas, s.rank
        if len(taken) == dp_size:
            skip = taken[dp_rank]
        elif len(set(taken)) != 1:
            raise MismatchError(f"the saved ranks had consumed different numbers of samples ({taken}): the consumed "
                                f"positions are not a prefix of the order, so they cannot be continued on {dp_size} "
                                "DP ranks", key=_KEY)
        else:
            total = taken[0] * len(taken)
            skip, rest = divmod(total, dp_size)
            if rest or skip % self.batch_size:
                raise MismatchError(
                    f"the {len(taken)} saved ranks had consumed {total} samples of the epoch; a DistributedSampler on "
                    f"{dp_size} ranks can only resume at a whole number of batches of {self.batch_size} per rank "
                    f"({total} / {dp_size} is {total / dp_size:g} samples), so that position cannot be continued "
                    "exactly; use bcp.ResumableDistributedSampler to resume anywhere", key=_KEY)
        s.set_epoch(int(replicated["epoch"]))
        if skip == 0:
            self._restart()
        else:
            state = skipping(self.loader.state_dict(), skip // self.batch_size, self.batch_size,
                             finished=skip >= s.num_samples)
            self.loader.load_state_dict(state)


def batches_yielded(state: dict[str, Any]) -> int:
    """The batches a StatefulDataLoader had yielded to the trainer in its epoch, from its state."""
    if "_snapshot" in state:
        return int(state["_snapshot"]["_snapshot_step"]) + int(state["_steps_since_snapshot"])
    return int(state["_num_yielded"])


def reshard_states(saved: list[dict[str, Any]], dp_rank: int, dp_size: int) -> dict[str, Any]:
    """The state for DP rank ``dp_rank`` of ``dp_size`` of a StatefulDataLoader whose ranks walk
    their shards of one global order (torch's ``DistributedSampler``, bcp's sampler, or a batch
    sampler dealing batches round-robin), from the states of the ``len(saved)`` ranks that saved it
    (DP order). The saved ranks consumed ``n`` batches each, the first ``n x D`` of the order; the
    new ones skip ``n x D / D'`` each. Refused where that is not whole, where the ranks consumed
    different counts, or where the state holds positions of an iterable dataset's read workers."""
    if len(saved) == dp_size:
        return saved[dp_rank]
    for state in saved:
        for worker in (state.get("_snapshot", {}).get("_worker_snapshots") or {}).values():
            if worker and (worker.get("dataset_state") is not None or worker.get("fetcher_state") is not None):
                raise MismatchError(
                    f"the StatefulDataLoader's read workers hold positions within the {len(saved)} saved ranks' shards "
                    "of an iterable dataset, which bcp cannot split or merge", key=_KEY)
    iter_states = [(s["_snapshot"]["_main_snapshot"] if "_snapshot" in s else s).get("_sampler_iter_state") for s in saved]
    if any(state and "sampler_state" in state for state in iter_states):
        raise MismatchError("the StatefulDataLoader's sampler keeps its own position (it has state_dict), which bcp "
                            f"cannot move from {len(saved)} ranks to {dp_size}", key=_KEY)
    counts = [batches_yielded(state) for state in saved]
    if len(set(counts)) != 1:
        raise MismatchError(f"the saved ranks had consumed different numbers of batches ({counts}): the consumed "
                            f"positions are not a prefix of the order, so they cannot be continued on {dp_size} "
                            "DP ranks", key=_KEY)
    batches, rest = divmod(counts[0] * len(saved), dp_size)
    if rest:
        raise MismatchError(f"the {len(saved)} saved ranks had consumed {counts[0] * len(saved)} batches of the epoch, "
                            f"which is no whole number of batches on each of {dp_size} ranks; a StatefulDataLoader "
                            "resumes only at a whole batch", key=_KEY)
    main = saved[0]["_snapshot"]["_main_snapshot"] if "_snapshot" in saved[0] else saved[0]
    iter_state, handed = iter_states[0], int(main["_sampler_iter_yielded"])
    batch_size = iter_state["samples_yielded"] // handed if iter_state and handed else 0
    return skipping(saved[0], batches, batch_size, finished=all(state["_iterator_finished"] for state in saved))


def skipping(fresh: dict[str, Any], batches: int, batch_size: int, *, finished: bool) -> dict[str, Any]:
    """A StatefulDataLoader state that resumes ``batches`` batches into its sampler's epoch order,
    made from a state of the same loader (``fresh``): its batch sampler skips them (torchdata's batch
    sampler skips ``batches x batch_size`` samples; another batch sampler, ``batches`` batches) and
    the loader counts them yielded. ``finished``: the epoch was over, the next iteration starts the
    next one (as torchdata restores a finished loader)."""
    state = copy.deepcopy(fresh)
    main = state["_snapshot"]["_main_snapshot"] if "_snapshot" in state else state
    if main.get("_sampler_iter_state") is not None:
        main["_sampler_iter_state"] = {"samples_yielded": batches * batch_size}
    main["_sampler_iter_yielded"] = batches
    if "_snapshot" in state:
        state["_snapshot"]["_snapshot_step"] = batches
        state["_snapshot"]["_last_yielded_worker_id"] = (batches - 1) % main["_num_workers"]
        state["_steps_since_snapshot"] = 0
    else:
        state["_num_yielded"] = batches
    state["_iterator_finished"] = finished
    return state
