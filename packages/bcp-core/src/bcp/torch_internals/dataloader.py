"""Where bcp reads torch's and torchdata's dataloaders beyond their public API.

What the trainer consumed from a loader with read workers is known only to the loader's iterator (it
counts the batches it yielded; the sampler has handed out more, for the workers to read ahead), and
torch keeps that iterator and its count private; torchdata's ``StatefulDataLoader`` exposes them only
inside its ``state_dict()``, whose keys are its own format. Every such name bcp relies on is read here:

- an iterator's count of batches yielded, its batch sampler, whether it reads ahead (read workers)
  and delivers in order; a loader's current iterator and the state it will restore;
- ``DataLoader._get_iterator``, through which bcp follows the iterators a plain ``DataLoader`` with
  read workers makes (it hands them to the trainer only);
- the iterator among the callers of a sampler's iteration (bcp's sampler saved without its loader);
- torchdata's state keys for the batches yielded, whether the epoch ended and the read workers'
  dataset states.

``TESTED`` (in the package) names the versions these names were checked in;
``tests/dataloader/test_dataloader_torch_internals.py`` fails when one moves.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.utils.data import DataLoader, dataloader

from bcp.torch_internals import private_name

_BaseDataLoaderIter = private_name(dataloader, "_BaseDataLoaderIter")


def batches_yielded(iterator: _BaseDataLoaderIter) -> int:
    """The batches a loader iterator has yielded to its consumer."""
    return int(private_name(iterator, "_num_yielded"))


def batch_sampler_of(iterator: _BaseDataLoaderIter) -> Any:
    """The batch sampler an iterator draws indices from (None without automatic batching)."""
    return private_name(iterator, "_index_sampler")


def reads_ahead(iterator: _BaseDataLoaderIter) -> bool:
    """Whether the iterator's read workers ask for indices ahead of its consumer."""
    return private_name(iterator, "_num_workers") > 0


def in_order(iterator: _BaseDataLoaderIter) -> bool:
    """Whether the iterator delivers batches in the order of their indices (torch before 2.6 has no
    ``_in_order``: always)."""
    return bool(getattr(iterator, "_in_order", True))


def current_iterator(loader: DataLoader) -> _BaseDataLoaderIter | None:
    """The iterator a loader keeps (persistent workers, torchdata's StatefulDataLoader), or None."""
    return private_name(loader, "_iterator")


def drop_iterator(loader: DataLoader) -> None:
    """Make a loader with persistent workers build a fresh iterator at its next iteration."""
    current_iterator(loader)  # fails naming the name where torch moved it
    loader._iterator = None


def finished(loader: DataLoader) -> bool:
    """Whether a StatefulDataLoader's current iterator has reached the end of its epoch."""
    iterator = current_iterator(loader)
    return iterator is not None and bool(getattr(iterator, "_finished", False))


def pending_state(loader: DataLoader) -> dict[str, Any] | None:
    """The state a StatefulDataLoader will restore at its next iteration (loaded, not yet iterated)."""
    return getattr(loader, "next_iter_state", None)


def on_new_iterator(loader: DataLoader, keep: Any) -> None:
    """Call ``keep(iterator)`` with every iterator ``loader`` makes from now on (torch's DataLoader
    makes each one through ``_get_iterator``)."""
    make = private_name(loader, "_get_iterator")

    def get_iterator() -> Any:
        iterator = make()
        keep(iterator)
        return iterator

    loader._get_iterator = get_iterator


def calling_iterator(depth: int = 8) -> _BaseDataLoaderIter | None:
    """The DataLoader iterator among the callers of the function calling this one (a batch sampler
    asks its sampler for indices from inside the iterator's methods), or None."""
    frame = sys._getframe(2)
    while frame is not None and depth:
        caller = frame.f_locals.get("self")
        if isinstance(caller, _BaseDataLoaderIter):
            return caller
        frame, depth = frame.f_back, depth - 1
    return None


def state_batches_yielded(state: dict[str, Any]) -> int:
    """The batches a StatefulDataLoader had yielded to the trainer in its epoch, from its state (a
    ``KeyError`` for another loader's state)."""
    if "_snapshot" in state:
        return int(state["_snapshot"]["_snapshot_step"]) + int(state["_steps_since_snapshot"])
    return int(state["_num_yielded"])


def state_finished(state: dict[str, Any]) -> bool:
    """Whether a StatefulDataLoader's state is at the end of its epoch (a ``KeyError`` for another
    loader's state)."""
    return bool(state["_iterator_finished"])


def state_dataset_states(state: dict[str, Any]) -> list[Any]:
    """The dataset states a StatefulDataLoader's state holds: one per read worker (or the loader's own)."""
    if "_snapshot" in state:
        workers = state["_snapshot"].get("_worker_snapshots") or {}
        return [workers[name].get("dataset_state") for name in sorted(workers)]
    return [state.get("dataset_state")]
