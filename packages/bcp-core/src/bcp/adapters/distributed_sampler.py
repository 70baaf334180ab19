"""A distributed sampler whose position survives a change of the DP size (a :class:`ShardedDataloader`).

It walks the epoch's permutation as torch's ``DistributedSampler`` does (the same permutation for a
seed and epoch; DP rank ``r`` of ``D`` takes positions ``r, r + D, r + 2D, ...``) but does not pad the
last round. Its position is global: the epoch, the position the epoch resumed from, and how many
samples each rank has taken since. A load on another DP size continues the global order at the
first position not yet taken; that is exact when every rank had taken the same number of samples
(ranks step in lockstep), and refused otherwise, since the taken positions are then not a prefix.

Inside a DataLoader with read workers the loader asks for indices ahead of its trainer, so what the
sampler handed out is not what the trainer consumed. The sampler finds the loader iterator that
walks it (the caller of its iteration) and, saved on its own, counts the batches that iterator
yielded instead: exact for batches made by the loader's own batch sampler and delivered in order,
refused otherwise.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.utils.data import BatchSampler

from bcp.torch_internals import dataloader as loader_internals
from bcp.errors import CheckpointError, MismatchError

if TYPE_CHECKING:  # the dataloader module builds on this one
    from bcp.adapters.part_key import PartKey


class ResumableDistributedSampler(torch.utils.data.Sampler[int]):
    """Indices of a dataset of ``size`` samples for DP rank ``dp_rank`` of ``dp_size``.

    Every iteration walks the epoch from where it resumed (its start after ``set_epoch``, the loaded
    position after a load), as torch's sampler walks it from the start: a loader may make iterators
    it drops (a trainer's check that it is iterable) without losing what their workers read ahead.
    ``taken`` counts what the latest iteration handed out, from the resume position."""

    def __init__(self, size: int, *, dp_rank: int, dp_size: int, shuffle: bool = True, seed: int = 0) -> None:
        self.size, self.dp_rank, self.dp_size, self.shuffle, self.seed = size, dp_rank, dp_size, shuffle, seed
        self.epoch, self.start, self.taken = 0, 0, 0
        #: Where every iteration of this epoch begins, counted like ``taken``.
        self.resume_at = 0
        self._iterations = 0
        #: The loader iterator walking the latest iteration (None: not a loader's), and whether it
        #: read ahead of its trainer (it had read workers).
        self._reader: weakref.ref[Any] | None = None
        self._read_ahead = False

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first sample. The current epoch keeps its position: trainers
        call ``set_epoch(current)`` when they resume (after the load brought the position back) and
        after their loader's workers began reading (Lightning's fit loop)."""
        if epoch != self.epoch:
            self.epoch, self.start, self.taken, self.resume_at = epoch, 0, 0, 0

    def order(self) -> list[int]:
        """The epoch's global order (the permutation every rank walks)."""
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        self._iterations += 1
        self.taken = self.resume_at
        return self._walk(self._iterations, self.resume_at)

    def _walk(self, iteration: int, taken: int) -> Iterator[int]:
        if iteration == self._iterations:
            reader = loader_internals.calling_iterator()
            self._reader = None if reader is None else weakref.ref(reader)
            self._read_ahead = reader is not None and loader_internals.reads_ahead(reader)
        order = self.order()
        while (position := self.start + self.dp_rank + taken * self.dp_size) < self.size:
            taken += 1
            if iteration == self._iterations:  # a dropped iterator's workers may still read: not counted
                self.taken = taken
            yield order[position]

    def __len__(self) -> int:
        return len(range(self.start + self.dp_rank + self.resume_at * self.dp_size, self.size, self.dp_size))

    def replicated_state(self) -> dict[str, Any]:
        return {"size": self.size, "shuffle": self.shuffle, "seed": self.seed, "epoch": self.epoch, "start": self.start}

    def sharded_states(self) -> list[dict[str, Any]]:
        return [{"taken": self.consumed()}]

    def consumed(self) -> int:
        """Samples of this rank's epoch the trainer has consumed, counted like ``taken``: what the
        sampler handed out, or, under a loader whose read workers ask ahead, the batches it yielded."""
        if not self._read_ahead:
            return self.taken
        reader = self._reader() if self._reader is not None else None
        if reader is None:
            if self.taken == self.resume_at + len(self):
                return self.taken  # the epoch was read to its end and the trainer finished it
            raise CheckpointError("a DataLoader's read workers asked this sampler for indices ahead of the trainer, "
                                  "and the loader's iterator is gone, so what the trainer consumed is unknown; save "
                                  "while iterating, or put the loader in the DataloaderState", key="dataloader")
        batches = loader_internals.batch_sampler_of(reader)
        walks_ours = loaders_own_batch_sampler(batches) and batches.sampler is self
        if not walks_ours or not loader_internals.in_order(reader):
            raise CheckpointError("this sampler is walked by a DataLoader with read workers whose batches are not its "
                                  "batch_size batches of this sampler's order delivered in order (a custom batch sampler "
                                  "or in_order=False), so what the trainer consumed is unknown", key="dataloader")
        return min(self.resume_at + loader_internals.batches_yielded(reader) * batches.batch_size, self.taken)

    @staticmethod
    def assign_parts(saved: list[PartKey], dp_size: int) -> list[list[PartKey]]:
        """Every rank reads every rank's count: the global position needs them all (they are tiny)."""
        return [list(saved) for _ in range(dp_size)]

    def load_dataloader_state(self, replicated: Any, sharded: list[Any]) -> None:
        config = {k: replicated[k] for k in ("size", "shuffle", "seed")}
        if config != {"size": self.size, "shuffle": self.shuffle, "seed": self.seed}:
            raise MismatchError(f"the sampler was saved with {config}", key="dataloader/replicated")
        start = int(replicated["start"])
        taken = [int(part["taken"]) for part in sharded]  # one part per saved DP rank, in DP order
        if len(taken) == self.dp_size:
            mine = taken[self.dp_rank]
        elif len(set(taken)) == 1:
            start, mine = start + taken[0] * len(taken), 0
        else:
            raise MismatchError(f"the saved ranks had taken different numbers of samples ({taken}): the taken "
                                f"positions are not a prefix of the order, so they cannot be continued on "
                                f"{self.dp_size} DP ranks", key="dataloader")
        self.epoch, self.start, self.taken, self.resume_at = int(replicated["epoch"]), start, mine, mine


def loaders_own_batch_sampler(batch_sampler: Any) -> bool:
    """Whether the batch sampler is the one a loader makes from ``batch_size`` (torch's or torchdata's)."""
    return isinstance(batch_sampler, BatchSampler) and type(batch_sampler).__module__.startswith(
        ("torch.utils.data", "torchdata.stateful_dataloader"))
