"""The fit loop's dataloader states as bcp's ``dataloader`` component.

Lightning's fit loop puts the ``state_dict()`` of every stateful train dataloader (a torchdata
``StatefulDataLoader``, or any loader with ``state_dict``/``load_state_dict``) into its checkpoint
at ``loops.fit_loop.state_dict.combined_loader``, and gives them back to the loaders when a fit
resumes. bcp_lightning takes that list out of Lightning's other entries and saves it through
``bcp.DataloaderState``, each saving rank as its own DP index, since the loop's state is per rank
(every rank under bcp_lightning's strategies, also under tensor parallelism; rank 0 alone through
the plugin, whose part every rank then reads, as Lightning does). Resuming on the same DP size
gives each rank its own loaders' states; on another, each loader's state is resharded where its
ranks walk shards of one global order (torch's ``DistributedSampler``, which Lightning puts in under
DDP, or bcp's sampler) and the consumed batches divide among the new ranks, and refused otherwise.

A shuffled train loader (``StatefulDataLoader(shuffle=True)``: Lightning wraps its ``RandomSampler``
in a ``DistributedSamplerWrapper`` under DDP) draws each epoch's permutation from the sampler's
generator, which moves on, and nothing of it is in the loader's state: a resume would walk another
permutation. From the plugin's construction on (:func:`install`), the fit loop's train loaders'
samplers are followed as Lightning sets them up; a save keeps, beside each loader's state, the
generator state its epoch was drawn from (read off the live loaders of the fit that saves), and a
resume replays it in the loaders of the next fit's data setup (``bcp.integration.replay_order``).
A save of a shuffled loader whose draw was not seen is refused.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import weakref
from typing import Any, Mapping

import torch

import bcp
from bcp.integration import batches_yielded, draws_its_order, drawn_from, follow_order, replay_order, reshard_states
from bcp.integration import DATALOADER_COMPONENT as COMPONENT
from bcp.integration import default_coordinator

_PATH = ("loops", "fit_loop", "state_dict")
_KEY = "combined_loader"
_BATCH_PROGRESS = "epoch_loop.batch_progress"


class FitLoopLoaders:
    """The fit loop's list of loader states (one per train dataloader), as bcp saves and restores it.

    ``rank`` and ``world`` are the training process's place among the DP ranks whose loaders the
    saved states stand for: every rank saves its own under bcp_lightning's strategies; through the
    plugin rank 0's states stand for all ``world`` ranks (Lightning's own assumption: DDP ranks step
    in lockstep). On another number of ranks each loader's state is resharded from all the saved
    ranks' (:func:`bcp.integration.reshard_states`)."""

    def __init__(self, states: list[Any] | None = None, draws: list[torch.Tensor | None] | None = None) -> None:
        self.states = states
        #: Per loader, the generator state its epoch's order was drawn from (None: not drawn from one).
        self.draws = draws
        self.rank, self.world = _ranks()
        #: How many more batches of the epoch this rank has after a reshard than the saved ranks had.
        self.batches_moved = 0

    def replicated_state(self) -> None:
        return None

    def sharded_states(self) -> list[dict[str, Any]]:
        part = {"loaders": self.states, "world": self.world}
        if self.draws is not None and any(draw is not None for draw in self.draws):
            part["drawn_from"] = self.draws
        return [part]

    @staticmethod
    def assign_parts(saved: list[bcp.PartKey], dp_size: int) -> list[list[bcp.PartKey]]:
        """Every rank reads every saved rank's states: a DP change needs them all (they are small)."""
        return [list(saved) for _ in range(dp_size)]

    def load_dataloader_state(self, replicated: Any, sharded: list[Any]) -> None:
        per_rank = [part["loaders"] for part in sharded]  # in DP order
        draws = [part.get("drawn_from") for part in sharded]
        if len(per_rank) == 1:
            per_rank, draws = per_rank * int(sharded[0].get("world", 1)), draws * int(sharded[0].get("world", 1))
        if len(per_rank) == self.world:
            self.states, self.draws = per_rank[self.rank], draws[self.rank]
            return
        self.draws = _shared_draws(draws)
        self.states = [reshard_states([states[i] for states in per_rank], self.rank, self.world)
                       for i in range(len(per_rank[0]))]
        if self.states:
            self.batches_moved = batches_yielded(self.states[0]) - batches_yielded(per_rank[0][0])


    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The states from a checkpoint that saved them as one ``state_dict`` per rank."""
        self.states = state["loaders"]


def _shared_draws(draws: list[list[torch.Tensor | None] | None]) -> list[torch.Tensor | None] | None:
    """The draws every saved rank made, for ranks of another number: each loader's must be the same on
    every saved rank (Lightning's ranks each draw the permutation their shards are cut from)."""
    first = draws[0]
    for other in draws[1:]:
        same = (other is None) == (first is None) and (first is None or all(
            (a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in zip(first, other)))
        if not same:
            raise bcp.MismatchError("the saved ranks drew their train loaders' epoch orders from different generator "
                                    "states, so there is no one global order to continue on another number of ranks",
                                    key=COMPONENT)
    return first


def _ranks() -> tuple[int, int]:
    """This process's rank and the number of training processes (Lightning's DDP ranks)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def take_out(rest: Mapping[str, Any], coordinator: bcp.Coordinator) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's other entries without the loader states (copied along the path, the caller's dict
    is left as it is), and the components to save: a ``dataloader`` entry where there are states."""
    loop = _loop_state(rest)
    if loop is None or not loop.get(_KEY):
        return dict(rest), {}
    states = loop[_KEY]
    outer = dict(rest)
    level = outer
    for key in _PATH:
        level[key] = dict(level[key])
        level = level[key]
    del level[_KEY]
    return outer, {COMPONENT: bcp.DataloaderState(FitLoopLoaders(states, _epoch_draws(states)),
                                                   dp_rank=coordinator.rank, dp_size=coordinator.world_size)}


def template(saved: bool, coordinator: bcp.Coordinator) -> dict[str, Any]:
    """The component to load into, where the checkpoint's layout says loader states were saved."""
    if not saved:
        return {}
    return {COMPONENT: bcp.DataloaderState(FitLoopLoaders(), dp_rank=coordinator.rank,
                                           dp_size=coordinator.world_size)}


def put_back(rest: dict[str, Any], loaded: Mapping[str, Any]) -> None:
    """Give the loaded loader states back to the fit loop's entry, where Lightning looks for them.
    Resharded, the loop's count of batches done in the epoch moves with the loaders' (it ends the
    epoch when that count reaches the new ranks' number of batches)."""
    if COMPONENT not in loaded:
        return
    loaders = loaded[COMPONENT].loader
    loop = _loop_state(rest)
    if loop is not None:
        loop[_KEY] = loaders.states
    _FOLLOWED.states, _FOLLOWED.draws = loaders.states, list(loaders.draws or [])
    progress = rest.get("loops", {}).get("fit_loop", {}).get(_BATCH_PROGRESS)
    if loaders.batches_moved and progress:
        progress["current"] = {name: count + loaders.batches_moved for name, count in progress["current"].items()}


def _loop_state(rest: Mapping[str, Any]) -> dict[str, Any] | None:
    level: Any = rest
    for key in _PATH:
        level = level.get(key) if isinstance(level, Mapping) else None
    return level if isinstance(level, dict) else None


# Following the train loaders' samplers.

class _Followed:
    """The fit whose train loaders were set up last (their samplers followed), and the draws the
    latest load left to replay: in the loaders of the fit that restores ``states`` (the list of
    loader states the load gave back, which the fit loop keeps until it restores them)."""

    trainer: "weakref.ref[Any] | None" = None
    states: list[Any] | None = None
    draws: list[torch.Tensor | None] = []


_FOLLOWED = _Followed()
_FOLLOWS = "_bcp_follows_orders"
_FIT_LOOP_MODULES = ("lightning.pytorch.loops.fit_loop", "pytorch_lightning.loops.fit_loop")


def install() -> None:
    """Follow the samplers of the train loaders every fit sets up from now on (idempotent): Lightning's
    fit loop prepares each train loader with ``_process_dataloader``, before it restores their states
    and iterates them."""
    for name in _FIT_LOOP_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if not getattr(module._process_dataloader, _FOLLOWS, False):
            module._process_dataloader = _following(module._process_dataloader)


def _following(original: Any) -> Any:
    @functools.wraps(original)
    def process_dataloader(trainer: Any, trainer_fn: Any, stage: Any, dataloader: object) -> object:
        loader = original(trainer, trainer_fn, stage, dataloader)
        if _FOLLOWED.trainer is None or _FOLLOWED.trainer() is not trainer:
            _FOLLOWED.trainer = weakref.ref(trainer)
        sampler = drawing_sampler(loader)
        if sampler is not None:
            follow_order(sampler)
            _check_ranks_draw_alike(sampler)
        restoring = getattr(trainer.fit_loop, "_combined_loader_states_to_load", None)
        if _stateful(loader) and restoring is not None and restoring is _FOLLOWED.states and _FOLLOWED.draws:
            draw = _FOLLOWED.draws.pop(0)  # the loaders come in the order of their saved states
            if draw is not None:
                if sampler is None:
                    raise bcp.MismatchError("a train dataloader was saved with an order drawn from a generator "
                                            "(shuffle=True) and the live one draws none", key=COMPONENT)
                replay_order(sampler, draw)
        return loader

    setattr(process_dataloader, _FOLLOWS, True)
    return process_dataloader


def _check_ranks_draw_alike(sampler: Any) -> None:
    """Every rank cuts its shard out of the permutation its own sampler draws: refused, on every rank
    (the fit sets its loaders up in step), where the ranks' generators differ, since the epoch is then
    no permutation of the dataset and no checkpoint of it can be resumed exactly."""
    generator = getattr(sampler, "generator", None)
    if generator is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_world_size() == 1:
        return
    digests = default_coordinator().all_gather_bytes(hashlib.sha256(generator.get_state().numpy().tobytes()).digest())
    if len(set(digests)) > 1:
        raise bcp.CheckpointError(
            f"the train dataloader's {type(sampler).__name__} has a different generator state on each rank, so each "
            "rank draws its own permutation and cuts its shard out of it: an epoch is no permutation of the dataset "
            "(samples are skipped and repeated), and a checkpoint of it cannot be resumed exactly. Seed every rank "
            "alike before the loader is built (lightning.seed_everything), or give the loader a seeded generator",
            key=COMPONENT)


def drawing_sampler(loader: Any) -> Any:
    """The sampler of a train loader that draws its order from a moving generator, or None: the
    loader's or its batch sampler's (Lightning rebuilds torchdata's batch sampler around the sampler it
    puts in), or the one Lightning's ``DistributedSamplerWrapper`` wraps."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        wrapped = getattr(getattr(sampler, "dataset", None), "_sampler", None)  # Lightning's _DatasetSamplerWrapper
        for candidate in (sampler, wrapped):
            if candidate is not None and draws_its_order(candidate):
                return candidate
    return None


def _stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _epoch_draws(states: list[Any]) -> list[torch.Tensor | None] | None:
    """Per saved loader state, the generator state its epoch's order was drawn from, read off the
    live train loaders of the fit that saves (None where it is not shuffled from a generator, or
    where no fit set loaders up in this process). Refused where a shuffled loader's draw was unseen."""
    trainer = _FOLLOWED.trainer() if _FOLLOWED.trainer is not None else None
    combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    if combined is None:
        return None
    live = [loader for loader in combined.flattened if _stateful(loader)]
    if len(live) != len(states):
        return None
    draws: list[torch.Tensor | None] = []
    for index, (loader, state) in enumerate(zip(live, states)):
        sampler = drawing_sampler(loader)
        mid_epoch = isinstance(state, dict) and not state.get("_iterator_finished") and _yielded(state)
        if sampler is None or not mid_epoch:
            draws.append(None)
        elif (draw := drawn_from(sampler)) is None:
            raise bcp.CheckpointError(
                f"train dataloader {index}: its {type(sampler).__name__} drew this epoch's order from its generator "
                "before bcp followed it, and the generator has moved on since, so a resume could not walk the same "
                "order; construct BCPCheckpointIO (or a bcp_lightning strategy) before the fit sets up its data",
                key=COMPONENT)
        else:
            draws.append(draw)
    return draws


def _yielded(state: dict[str, Any]) -> int:
    try:
        return batches_yielded(state)
    except KeyError:  # not a StatefulDataLoader's state
        return 0
