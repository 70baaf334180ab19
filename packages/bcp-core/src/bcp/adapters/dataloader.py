"""The ``dataloader`` component: a loader's state as a replicated part (saved once) and sharded
parts (one per read worker of each data-parallel rank), redistributed when the DP size changes.

A checkpoint stores them as per-rank values under ``dataloader/``: ``dataloader/replicated`` (written
by the writer of DP index 0) and ``dataloader/shard/dp<d>-of-<D>/worker<w>-of-<W>`` (written by the
writer of DP index ``d``: the TP/PP rank 0 of that DP group). The names alone say which parts exist,
so a rank knows before reading anything which parts it needs and whether any is missing.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable

from bcp.adapters.part_key import PartKey
from bcp.adapters.iterable_shards import IterableShards, reshardable
from bcp.adapters.torch_dataloader import position_of, why_opaque
from bcp.errors import CheckpointError, CorruptCheckpointError, MismatchError

COMPONENT = "dataloader"
REPLICATED = "replicated"
#: How the replicated part says what the sharded parts are.
_SHARDED, _PER_RANK = "sharded", "per_rank_state_dict"


@runtime_checkable
class ShardedDataloader(Protocol):
    """A loader whose state separates what every DP rank shares from what each read worker holds.

    ``sharded_states()`` gives one state per read worker of this DP rank (token buffer, per-source
    offsets...), each an atom that moves whole to a new DP rank when the DP size changes;
    ``load_dataloader_state`` receives the replicated state and the sharded states assigned to this
    rank (by :func:`assign_parts`, or the loader's own ``assign_parts`` method when it has one), in
    order. Every state is a value of bcp's safe encoding (JSON types, tensors, bytes...).

    Optionally, ``plan_checkpoints(every)``: the state will be collected after every ``every``-th
    batch, so the loader may prepare it one step ahead (prefetching, paper section 4.5) and
    ``sharded_states()`` at those steps returns without waiting for its read workers.
    """

    def replicated_state(self) -> Any: ...

    def sharded_states(self) -> list[Any]: ...

    def load_dataloader_state(self, replicated: Any, sharded: list[Any]) -> None: ...


def assign_parts(saved: list[PartKey], dp_size: int) -> list[list[PartKey]]:
    """The saved parts each of ``dp_size`` new DP ranks receives.

    Same DP size: every DP index gets its own parts back. Otherwise the parts are dealt round-robin
    in (worker, dp) order: the order in which a DP-agnostic global stream of parts was dealt to the
    saving ranks, so dealing again is stable (the same size gives the same assignment) and every
    part goes to exactly one new rank. A part is never split: with more new ranks than parts, some
    ranks receive none.
    """
    if saved and saved[0].dp_size == dp_size:
        return [[key for key in sorted(saved) if key.dp == dp] for dp in range(dp_size)]
    dealt: list[list[PartKey]] = [[] for _ in range(dp_size)]
    for i, key in enumerate(sorted(saved, key=lambda k: (k.worker, k.dp))):
        dealt[i % dp_size].append(key)
    return dealt


class DataloaderState:
    """The value of a state dict's ``"dataloader"`` entry: a loader and where this rank stands.

    ``loader`` is a :class:`ShardedDataloader` (resharded exactly when the DP size changes) or any
    object with ``state_dict``/``load_state_dict`` such as torchdata's ``StatefulDataLoader`` (saved
    as one part per DP index; restored only on the same DP size, since its state is one opaque
    position within its own DP shard of the data). ``writer``: whether this rank writes its DP
    index's parts; exactly one rank per DP group should (the TP/PP rank 0 of that group), every
    rank of the group reads them back. ``checkpoint_every``: the number of batches between saves,
    passed to the loader's ``plan_checkpoints`` so that it prefetches its state (build the
    ``DataloaderState`` before training for it to take effect from the first checkpoint).
    """

    def __init__(self, loader: Any, *, dp_rank: int, dp_size: int, writer: bool = True,
                 checkpoint_every: int | None = None) -> None:
        if not (isinstance(dp_size, int) and dp_size >= 1 and isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
            raise CheckpointError(f"dataloader state needs 0 <= dp_rank < dp_size, got {dp_rank} of {dp_size}",
                                  key=COMPONENT)
        position = IterableShards(loader, dp_rank, dp_size) if reshardable(loader) else position_of(loader)
        sharded = position is not None or isinstance(loader, ShardedDataloader)
        if not sharded and not (callable(getattr(loader, "state_dict", None))
                                and callable(getattr(loader, "load_state_dict", None))):
            raise CheckpointError(f"a {type(loader).__name__} is neither a ShardedDataloader nor has "
                                  "state_dict/load_state_dict", key=COMPONENT)
        self.loader, self.dp_rank, self.dp_size, self.writer = loader, dp_rank, dp_size, writer
        #: What the parts are made from: the loader itself, or its trainer-consumed position.
        self._source = position if position is not None else loader
        if checkpoint_every is not None:
            plan = getattr(loader, "plan_checkpoints", None)
            if not callable(plan):
                raise CheckpointError(f"a {type(loader).__name__} cannot prefetch its state (it has no "
                                      "plan_checkpoints); leave checkpoint_every out", key=COMPONENT)
            plan(checkpoint_every)
        self._kind = _SHARDED if sharded else _PER_RANK

    def declaration(self) -> list[int]:
        """What this rank says of itself for the save's writer check: ``[dp_rank, dp_size, writer]``."""
        return [self.dp_rank, self.dp_size, int(self.writer)]

    def saved_values(self) -> dict[str, Any]:
        """The values this rank writes, by name under ``dataloader/`` (none unless it is a writer)."""
        if not self.writer:
            return {}
        states = self._source.sharded_states() if self._kind == _SHARDED else [self.loader.state_dict()]
        if not states:
            raise CheckpointError(f"DP index {self.dp_rank}: the loader gave no sharded state (one per read "
                                  "worker, at least one)", key=COMPONENT)
        values: dict[str, Any] = {}
        if self.dp_rank == 0:
            replicated = self._source.replicated_state() if self._kind == _SHARDED else None
            values[REPLICATED] = {"kind": self._kind, "dp_size": self.dp_size, "state": replicated}
        for worker, state in enumerate(states):
            key = PartKey(self.dp_rank, self.dp_size, worker, len(states))
            values[key.name] = {"dp": key.dp, "worker": key.worker, "state": state}
        return values

    def wanted(self, saved_names: Iterable[str], path: str | None = None) -> dict[str, bool]:
        """Every saved name under ``dataloader/`` -> whether this rank reads it (its parts after
        resharding, and the replicated part). Checks from the names alone that no part is missing."""
        names = list(saved_names)
        if REPLICATED not in names:
            raise MismatchError("the checkpoint holds no dataloader state (no dataloader/replicated)",
                                path=path, key=COMPONENT)
        keys = _complete_parts(names, path)
        if self._kind == _PER_RANK and keys and keys[0].dp_size != self.dp_size:
            raise MismatchError(
                f"the dataloader's state was saved on {keys[0].dp_size} DP ranks and is loaded on {self.dp_size}: "
                f"a {type(self.loader).__name__}'s state_dict is a position within its own DP shard of the data "
                f"and cannot be split or merged ({why_opaque(self.loader)}); implement bcp.ShardedDataloader to "
                "reshard it, or leave it out of the state", path=path, key=COMPONENT)
        assign = getattr(self._source, "assign_parts", assign_parts)
        mine = {key.name for key in assign(keys, self.dp_size)[self.dp_rank]}
        return {name: name == REPLICATED or name in mine for name in names}

    def restore(self, values: dict[str, Any], path: str | None = None) -> None:
        """Give the loader the values read (names under ``dataloader/``), parts in (worker, dp) order."""
        replicated = values[REPLICATED]
        parts = []
        for name, record in values.items():
            key = PartKey.parse(name)
            if key is None:
                continue
            if not (isinstance(record, dict) and record.get("dp") == key.dp and record.get("worker") == key.worker
                    and "state" in record):
                raise CorruptCheckpointError(f"the dataloader part of DP index {key.dp}, worker {key.worker} "
                                             "does not hold that part's record", path=path, key=f"{COMPONENT}/{name}")
            parts.append((key, record["state"]))
        parts.sort(key=lambda item: (item[0].worker, item[0].dp))
        kind = replicated.get("kind") if isinstance(replicated, dict) else None
        if kind == _PER_RANK and self._kind == _SHARDED and callable(getattr(self.loader, "load_state_dict", None)):
            self._restore_saved_state_dict(parts, path)
            return
        if kind != self._kind:
            raise MismatchError(f"the dataloader state was saved as {kind!r} state and the live loader is a "
                                f"{type(self.loader).__name__} ({self._kind!r})", path=path, key=COMPONENT)
        if self._kind == _SHARDED:
            self._source.load_dataloader_state(replicated["state"], [state for _, state in parts])
        else:
            self.loader.load_state_dict(parts[0][1])


    def _restore_saved_state_dict(self, parts: list[tuple[PartKey, Any]], path: str | None) -> None:
        """A loader bcp now saves as parts (a DataLoader's position, Lightning's fit loop states), from a
        checkpoint that holds its ``state_dict`` per DP index (as bcp saved it before): its own DP
        index's, on the same DP size only."""
        saved_size = parts[0][0].dp_size
        if saved_size != self.dp_size:
            raise MismatchError(f"the dataloader's state_dict was saved on {saved_size} DP ranks and is loaded on "
                                f"{self.dp_size}: it is a position within its own DP shard of the data",
                                path=path, key=COMPONENT)
        self.loader.load_state_dict(next(state for key, state in parts if key.dp == self.dp_rank))


def check_writers(declarations: list[list[int] | None]) -> None:
    """Every rank's :meth:`DataloaderState.declaration` (None: the rank passed no dataloader state):
    the ranks must agree on the DP size, and each DP index must have exactly one writer, else its
    parts would be missing or written twice. Raised before anything of the checkpoint is written."""
    declared = [d for d in declarations if d is not None]
    if not declared:
        return
    sizes = sorted({dp_size for _, dp_size, _ in declared})
    if len(sizes) > 1:
        raise CheckpointError(f"the ranks' dataloader states disagree on the DP size: {sizes}", key=COMPONENT)
    writers: dict[int, list[int]] = {dp: [] for dp in range(sizes[0])}
    for rank, declaration in enumerate(declarations):
        if declaration is not None and declaration[2]:
            writers[declaration[0]].append(rank)
    for dp, ranks in writers.items():
        if len(ranks) != 1:
            what = "no rank is" if not ranks else f"ranks {ranks} are all"
            raise CheckpointError(f"DP index {dp} of {sizes[0]}: {what} declared the writer of its dataloader parts "
                                  "(exactly one rank per DP group passes writer=True, the TP/PP rank 0 of the group)",
                                  key=COMPONENT)


def _complete_parts(names: list[str], path: str | None) -> list[PartKey]:
    """The saved parts; every DP index must have every one of its workers' parts."""
    keys = [key for name in names if (key := PartKey.parse(name)) is not None]
    if not keys:
        raise CorruptCheckpointError("the dataloader state has no sharded parts", path=path, key=COMPONENT)
    dp_size = keys[0].dp_size
    by_dp: dict[int, list[PartKey]] = {}
    for key in keys:
        if key.dp_size != dp_size or key.dp >= dp_size or key.worker >= key.workers:
            raise CorruptCheckpointError(f"dataloader part of DP index {key.dp} does not fit the DP size {dp_size}",
                                         path=path, key=f"{COMPONENT}/{key.name}")
        by_dp.setdefault(key.dp, []).append(key)
    for dp in range(dp_size):
        present = by_dp.get(dp, [])
        workers = present[0].workers if present else 0
        if not present or sorted(k.worker for k in present) != list(range(workers)) \
                or any(k.workers != workers for k in present):
            have = sorted(k.worker for k in present)
            raise CorruptCheckpointError(f"dataloader parts of DP index {dp} are missing (workers present: {have}"
                                         f"{f' of {workers}' if workers else ''})", path=path,
                                         key=f"{COMPONENT}/shard/dp{dp}-of-{dp_size}")
    return keys
