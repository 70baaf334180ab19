"""The fit loop's dataloader states as bcp's ``dataloader`` component, resumed on any number of ranks.

Lightning's fit loop puts the ``state_dict()`` of every stateful train dataloader (a torchdata
``StatefulDataLoader``, or any loader with ``state_dict``/``load_state_dict``) into its checkpoint
at ``loops.fit_loop.state_dict.combined_loader`` and gives them back to the loaders when a fit
resumes. bcp_lightning takes that list out of Lightning's other entries and saves it through
``bcp.DataloaderState``, each rank's beside that rank's *positions* (``bcp.integration``'s loader
positions: which order the epoch walks, which class of it the rank walks, how far the trainer got).

- Every rank's states and positions are saved: under bcp_lightning's strategies each rank saves its
  own part; through the plugin under Lightning's own strategies, whose checkpoint call happens on
  rank 0 alone, a callback gathers them from every rank while Lightning builds the checkpoint (on
  every rank) and rank 0 saves them all.
- On the same number of ranks each loader gets its own state back, and its sampler is set to the
  saved epoch and draw before the loop iterates it (Lightning's loop sets the epoch only after its
  first iteration of a resumed fit).
- On another number of ranks, or where the sampler now walks another order (a single device after
  DDP), the samples not yet consumed are dealt to the new ranks (``bcp.integration.plan_resume``):
  each loader delivers its share for the rest of the epoch (then its own order again) and the loop's
  count of the epoch's batches done is moved so that the epoch ends with the share.

A shuffled loader's order is drawn from its sampler's generator, which moves on: the samplers of the
train loaders are followed from the moment Lightning sets them up (``on_train_loader``), so a save
knows the state the epoch's permutation was drawn from.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import weakref
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch.utils.data import DistributedSampler

import bcp
from bcp.integration import DATALOADER_COMPONENT as COMPONENT
from bcp.integration import (SavedPosition, batching_of, consumed_batches, continue_own, default_coordinator,
                             deliver_resume, distributed_order, draws_its_order, follow_order, loader_position,
                             natural_walk, order_of_sampler, order_shape, plan_resume, refuse_unfollowed_draw,
                             resumed_epoch_of, unwrap_resumed)
from bcp_lightning import lightning_patch

_PATH = ("loops", "fit_loop", "state_dict")
_KEY = "combined_loader"
#: Where the callback puts every rank's loader states and positions in rank 0's checkpoint dict.
GATHERED = "bcp_dataloader_ranks"


class FitLoopLoaders:
    """The fit loop's loader states of the saving ranks (a :class:`bcp.ShardedDataloader`). Each part
    holds, per train loader, a rank's state and position; ``world`` is the number of training ranks.
    After a load, :attr:`resumes` says how each of this rank's loaders continues."""

    def __init__(self, ranks: list[dict[str, Any]] | None = None, world: int = 1, gathered: bool = False) -> None:
        self.ranks, self.world, self.gathered = ranks, world, gathered
        self.rank, self.live_world = _ranks()
        self.resumes: list[LoaderResume] = []

    def replicated_state(self) -> None:
        return None

    def sharded_states(self) -> list[dict[str, Any]]:
        mine = self.ranks[self.rank if len(self.ranks) > 1 else 0]
        part = {"loaders": mine["loaders"], "positions": mine["positions"], "world": self.world}
        if self.gathered:
            part["ranks"] = self.ranks
        return [part]

    @staticmethod
    def assign_parts(saved: list[bcp.PartKey], dp_size: int) -> list[list[bcp.PartKey]]:
        """Every rank reads every saved rank's part: a change of their number needs them all (they are small)."""
        return [list(saved) for _ in range(dp_size)]

    def load_dataloader_state(self, replicated: Any, sharded: list[Any]) -> None:
        if len(sharded) == 1 and "ranks" in sharded[0]:
            entries, world = sharded[0]["ranks"], int(sharded[0]["world"])
        else:
            entries, world = sharded, int(sharded[0].get("world", len(sharded))) if len(sharded) == 1 else len(sharded)
        self.ranks, self.world = entries, world
        self.resumes = [self._resume(i) for i in range(len(entries[0]["loaders"]))]
        if self.resumes:
            self.resumes[0].counts_batches = True

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The states from a checkpoint that saved them as one ``state_dict`` per rank."""
        self.ranks, self.world = [{"loaders": state["loaders"]}], self.live_world
        self.resumes = [LoaderResume(i, s, None, self.live_world, None) for i, s in enumerate(state["loaders"])]

    def _resume(self, index: int) -> "LoaderResume":
        complete = len(self.ranks) == self.world
        entry = self.ranks[self.rank if complete and self.world == self.live_world else 0]
        positions = [e.get("positions", [None] * (index + 1))[index] for e in self.ranks]
        own = SavedPosition.read((entry.get("positions") or [None] * (index + 1))[index],
                                 (entry.get("drawn_from") or [None] * (index + 1))[index])
        return LoaderResume(index, entry["loaders"][index], own, self.world,
                            positions if complete and all(p is not None for p in positions) else None,
                            complete=complete)


@dataclass
class LoaderResume:
    """How train loader ``index`` of this rank continues, decided once the fit has set it up: from
    ``state`` (its own; rank 0's where only rank 0's was saved) where it walks the saved epoch's order
    on as many ranks as saved it (``own``: that state's position, which sets its sampler's epoch and
    draw), else from every saved rank's ``positions``, the rest of the epoch dealt again."""

    index: int
    state: dict[str, Any]
    own: SavedPosition | None
    world: int
    positions: list[dict[str, Any]] | None
    complete: bool = True
    #: Whether this loader's share moves the loop's count of batches done (the first loader's does).
    counts_batches: bool = False

    def apply(self, trainer: Any, loader: Any, states: list[Any]) -> None:
        """Set the loader up to continue; ``states`` is the list the loop restores the loaders from."""
        walking, drawing = walking_sampler(loader), drawing_sampler(loader)
        if self.world == _ranks()[1] and (self.own is None or _walks_as_saved(walking, self.own)):
            if self.own is not None:
                continue_own(self.own, drawing, lambda epoch: _set_epoch(walking, epoch), loader="train dataloader")
                if self.own.finished:  # its state would end the next epoch at once: the next one starts fresh
                    states[self.index] = {}
            return
        self._refuse_without_positions()
        states[self.index] = {}
        batch_size, drop_last = _batching(loader)
        if batch_size is None:
            raise bcp.MismatchError(f"train dataloader {self.index} has a custom batch sampler: bcp cannot deal it "
                                    "the rest of a saved epoch; batch it with batch_size=", key=COMPONENT)
        rank, world = _ranks()
        resume = plan_resume(self.positions, world, rank, batch_size=batch_size, batch_drop_last=drop_last,
                             drop=drop_last or getattr(walking, "drop_last", False))
        _set_epoch(walking, resume.next_epoch())
        deliver_resume(loader, resume, drawing, record=self.positions[0])
        if self.counts_batches:
            done = lightning_patch.batches_done(trainer)
            lightning_patch.move_batches_done(trainer, len(loader) - resume.batches - done)

    def _refuse_without_positions(self) -> None:
        if not self.complete:
            raise bcp.MismatchError(
                f"train dataloader {self.index}: the checkpoint holds the loader position of rank 0 alone of the "
                f"{self.world} ranks that saved it (saved through BCPCheckpointIO under Lightning's own strategy by a "
                f"bcp_lightning that did not gather them), so it resumes only on {self.world} ranks walking the saved "
                "order", key=COMPONENT)
        if self.positions is None:
            raise bcp.MismatchError(
                f"train dataloader {self.index} was saved on {self.world} ranks and is resumed on {_ranks()[1]}, or "
                "with another sampler: its state is a position within each rank's own order that bcp cannot follow "
                "(an iterable dataset, a custom batch sampler, or a sampler other than torch's DistributedSampler, a "
                "sequential or random sampler, or bcp's), so the rest of its epoch cannot be dealt again",
                key=COMPONENT)


def _walks_as_saved(walking: Any, own: SavedPosition) -> bool:
    """Whether the live loader walks what its saved state walked: its own share of the same order (on
    as many ranks), not a resumed epoch's share. A state saved with its draw alone (before positions)
    is taken as its own."""
    if own.saved is None:
        return True
    if own.resumed:
        return False
    _set_epoch(walking, own.epoch)  # the order it walks in the saved epoch
    walk, saved = natural_walk(walking), own.saved["walk"]
    return (walk.world, walk.end) == (saved["world"], saved["end"]) \
        and _order(walking, shape_only=True) == order_shape(own.order)


def _set_epoch(sampler: Any, epoch: int | None) -> None:
    """The epoch to walk, before the loop's first iteration (nothing where it is unknown)."""
    if epoch is not None and callable(getattr(sampler, "set_epoch", None)):
        sampler.set_epoch(int(epoch))


def _ranks() -> tuple[int, int]:
    """This process's rank and the number of training processes (Lightning's DDP ranks)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


# Saving: Lightning's dict -> the component.

def take_out(rest: Mapping[str, Any], coordinator: bcp.Coordinator) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's other entries without the loader states (copied along the path, the caller's dict
    is left as it is), and the components to save: a ``dataloader`` entry where there are states."""
    loop = _loop_state(rest)
    outer = {k: v for k, v in rest.items() if k != GATHERED}
    if loop is None or not loop.get(_KEY):
        return outer, {}
    states = loop[_KEY]
    level = outer
    for key in _PATH:
        level[key] = dict(level[key])
        level = level[key]
    del level[_KEY]
    rank, world = _ranks()
    gathered = rest.get(GATHERED)
    if gathered is not None:
        loaders = FitLoopLoaders(gathered, world, gathered=True)
    else:
        loaders = FitLoopLoaders([{"loaders": states, "positions": positions(states)}], world)
    return outer, {COMPONENT: bcp.DataloaderState(loaders, dp_rank=coordinator.rank, dp_size=coordinator.world_size)}


def template(saved: bool, coordinator: bcp.Coordinator) -> dict[str, Any]:
    """The component to load into, where the checkpoint's layout says loader states were saved."""
    if not saved:
        return {}
    return {COMPONENT: bcp.DataloaderState(FitLoopLoaders(), dp_rank=coordinator.rank,
                                           dp_size=coordinator.world_size)}


def put_back(rest: dict[str, Any], loaded: Mapping[str, Any]) -> None:
    """Give the loader states back to the fit loop's entry, where Lightning looks for them, and keep
    how each loader resumes for the fit that restores them (:func:`on_train_loader`)."""
    if COMPONENT not in loaded:
        return
    loaders = loaded[COMPONENT].loader
    states = [resume.state for resume in loaders.resumes]
    loop = _loop_state(rest)
    if loop is not None:
        loop[_KEY] = states
    _PENDING.states, _PENDING.resumes = states, list(loaders.resumes)


def _loop_state(rest: Mapping[str, Any]) -> dict[str, Any] | None:
    level: Any = rest
    for key in _PATH:
        level = level.get(key) if isinstance(level, Mapping) else None
    return level if isinstance(level, dict) else None


def positions(states: list[Any]) -> list[dict[str, Any] | None]:
    """Per saved loader state, this rank's position in its epoch, read off the live train loaders of the
    fit that saves (None where bcp cannot follow its order, or no fit set loaders up here)."""
    trainer = followed_trainer()
    live = [loader for loader in lightning_patch.train_loaders(trainer) or [] if _stateful(loader)]
    if len(live) != len(states):
        return [None] * len(states)
    return [_position(index, loader, state) for index, (loader, state) in enumerate(zip(live, states))]


def _position(index: int, loader: Any, state: Any) -> dict[str, Any] | None:
    batch_size, drop_last = _batching(loader)
    if batch_size is None:
        return None  # a custom batch sampler: which samples its batches hold is its own
    counts = consumed_batches(state)
    if counts is None:
        return None  # not a StatefulDataLoader's state
    consumed, finished = counts[0] * batch_size, counts[1]
    walking, drawing = walking_sampler(loader), drawing_sampler(loader)
    order = _order(walking)
    if order is None and resumed_epoch_of(loader) is None:
        refuse_unfollowed_draw(drawing, consumed, finished, loader=f"train dataloader {index}", cause="",
                               remedy="construct BCPCheckpointIO (or a bcp_lightning strategy) before the fit sets "
                                      "up its data")
        return None  # an order bcp cannot rebuild (an iterable dataset, another sampler): its own state alone
    epoch = getattr(walking, "epoch", None)
    saved = loader_position(loader, order, natural_walk(walking), consumed=consumed, finished=finished, epoch=epoch,
                            batch_size=batch_size, batch_drop_last=drop_last,
                            drop=drop_last or getattr(walking, "drop_last", False),
                            generator=getattr(drawing, "generator", None) if drawing is not None else None)
    if saved is not None:
        saved["resumed"] = resumed_epoch_of(loader) is not None
    return saved


def _order(sampler: Any, *, shape_only: bool = False) -> dict[str, Any] | None:
    """The spec of the order the sampler walks this epoch, or None where bcp cannot rebuild it
    (``shape_only``: without the state a drawing sampler draws from)."""
    inner = lightning_patch.wrapped_sampler(sampler)
    if isinstance(sampler, DistributedSampler) and inner is not None:
        inner_order = order_of_sampler(inner, shape_only=shape_only)
        return None if inner_order is None else distributed_order(sampler, inner_order)
    return order_of_sampler(sampler, shape_only=shape_only)


# Following the train loaders as Lightning sets them up.

class _Followed:
    """The fit whose train loaders were set up last, and how the loaders of the fit that restores
    ``states`` (the list the latest load gave back) resume, in the order of their states."""

    trainer: "weakref.ref[Any] | None" = None
    states: list[Any] | None = None
    resumes: list[LoaderResume] = []


_FOLLOWED = _PENDING = _Followed()


def followed_trainer() -> Any | None:
    """The trainer of the fit whose train loaders were set up last (None: none yet, or it is gone)."""
    return _FOLLOWED.trainer() if _FOLLOWED.trainer is not None else None


def install() -> None:
    """Follow the train loaders every fit under Lightning's own strategies sets up from now on."""
    lightning_patch.install(on_train_loader)


def on_train_loader(trainer: Any, loader: Any) -> None:
    """A train loader Lightning has just set up (its sampler in place), before the loop restores its
    state and iterates it: follow its draws, and resume it where the fit restores a bcp checkpoint."""
    if not _ours(trainer):
        return
    if _FOLLOWED.trainer is None or _FOLLOWED.trainer() is not trainer:
        _FOLLOWED.trainer = weakref.ref(trainer)
    sampler = drawing_sampler(loader)
    if sampler is not None:
        follow_order(sampler)
        _check_ranks_draw_alike(sampler)
    restoring = lightning_patch.states_to_restore(trainer)
    if _stateful(loader) and restoring is not None and restoring is _PENDING.states and _PENDING.resumes:
        _PENDING.resumes.pop(0).apply(trainer, loader, restoring)
    if not getattr(trainer.strategy, "follows_train_loaders", False) and _ranks()[1] > 1:
        _gather_at_saves(trainer)


#: What marks bcp_lightning's checkpoint plugin (``CheckpointIOMixin``), read without importing it.
PLUGIN_MARK = "bcp_follows_train_loaders"


def _ours(trainer: Any) -> bool:
    """Whether the trainer checkpoints through bcp_lightning (directly, or under an async wrapper)."""
    io_plugin = getattr(trainer.strategy, "checkpoint_io", None)
    return getattr(io_plugin, PLUGIN_MARK, False) or getattr(getattr(io_plugin, "checkpoint_io", None), PLUGIN_MARK,
                                                             False)


def _gather_at_saves(trainer: Any) -> None:
    """Add the callback that gathers every rank's loader states and positions into rank 0's
    checkpoint dict (once per trainer)."""
    if any(getattr(callback, _GATHERS, False) for callback in trainer.callbacks):
        return
    base = importlib.import_module(f"{lightning_patch._package_of(trainer)}.callbacks").Callback
    trainer.callbacks.append(type("BCPLoaderPositions", (_GatherPositions, base), {})())


_GATHERS = "_bcp_gathers_loader_positions"


class _GatherPositions:
    """Lightning builds the checkpoint dict on every rank and calls the plugin on rank 0 alone: while
    it builds it, every rank's loader states and positions are gathered into it."""

    _bcp_gathers_loader_positions = True

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        loop = _loop_state(checkpoint)
        if loop is None or not loop.get(_KEY):
            return
        mine = {"loaders": loop[_KEY], "positions": positions(loop[_KEY])}
        checkpoint[GATHERED] = [_decoded(data) for data in default_coordinator().all_gather_bytes(_encoded(mine))]


def _encoded(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _decoded(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _check_ranks_draw_alike(sampler: Any) -> None:
    """Every rank cuts its shard out of the permutation its own sampler draws: refused, on every rank
    (the fit sets its loaders up in step), where the ranks' generators differ, since the epoch is then
    no permutation of the dataset and no checkpoint of it can be resumed exactly."""
    generator = getattr(sampler, "generator", None)
    if generator is None or _ranks()[1] == 1:
        return
    digests = default_coordinator().all_gather_bytes(hashlib.sha256(generator.get_state().numpy().tobytes()).digest())
    if len(set(digests)) > 1:
        raise bcp.CheckpointError(
            f"the train dataloader's {type(sampler).__name__} has a different generator state on each rank, so each "
            "rank draws its own permutation and cuts its shard out of it: an epoch is no permutation of the dataset "
            "(samples are skipped and repeated), and a checkpoint of it cannot be resumed exactly. Seed every rank "
            "alike before the loader is built (lightning.seed_everything), or give the loader a seeded generator",
            key=COMPONENT)


def walking_sampler(loader: Any) -> Any:
    """The sampler whose order the loader's batches walk (through a resumed epoch, the original)."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return unwrap_resumed(sampler) if sampler is not None else getattr(loader, "sampler", None)


def drawing_sampler(loader: Any) -> Any:
    """The sampler of a train loader that draws its order from a moving generator, or None: the
    loader's own, or the one Lightning's ``DistributedSamplerWrapper`` wraps."""
    sampler = walking_sampler(loader)
    for candidate in (sampler, lightning_patch.wrapped_sampler(sampler)):
        if candidate is not None and draws_its_order(candidate):
            return candidate
    return None


def _batching(loader: Any) -> tuple[int | None, bool]:
    """The loader's batch size and drop_last: its batch sampler's where it is torch's or torchdata's
    (Lightning rebuilds a loader with its batch sampler around the sampler it puts in), else None."""
    return batching_of(getattr(loader, "batch_sampler", None))


def _stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
