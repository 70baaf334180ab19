"""The accelerator's stateful dataloaders (``DataLoaderConfiguration(use_stateful_dataloader=True)``)
as bcp's ``dataloader`` component: each process's loaders' ``state_dict()`` saved as its DP index's
part through ``bcp.DataloaderState`` (accelerate would ``torch.save`` them from every process into
one shared file name), restored on the same number of processes and resharded on another.

A shuffled loader (``shuffle=True``, a ``RandomSampler``) draws each epoch's permutation from its
generator, which accelerate keeps in step across processes and which moves on as it is drawn
from: a restored loader would draw another permutation. bcp follows the sampler from
``prepare()`` on (:func:`install`) and saves, beside the loader's state, the generator state the
epoch's permutation was drawn from; the load replays it (``bcp.integration.replay_order``). A save
of a shuffled loader whose draw bcp did not see is refused.

Accelerate's own files still hold the rest of each loader (a seedable sampler): the loaders are
handed to it as :class:`SamplerOnly`, which tells it their state is not its to save or load.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import accelerate
import torch

import bcp
from bcp import CheckpointError, MismatchError
from bcp.integration import batches_yielded, draws_its_order, drawn_from, follow_order, replay_order, reshard_states
from bcp.integration import DATALOADER_COMPONENT

_FOLLOWS = "_bcp_follows_orders"


def is_stateful(loader: Any) -> bool:
    return bool(getattr(loader, "use_stateful_dataloader", False))


def install() -> None:
    """Follow the order drawn by every stateful dataloader ``Accelerator.prepare`` returns from now
    on (idempotent)."""
    cls = accelerate.Accelerator
    if getattr(cls.prepare_data_loader, _FOLLOWS, False):
        return
    original = cls.prepare_data_loader

    @functools.wraps(original)
    def prepare_data_loader(self: accelerate.Accelerator, data_loader: Any, *args: Any, **kwargs: Any) -> Any:
        # before accelerate wraps it: its stateful loader makes its first iterator (and draws) right away
        if (sampler := drawing_sampler(data_loader)) is not None:
            follow_order(sampler)
        return original(self, data_loader, *args, **kwargs)

    setattr(prepare_data_loader, _FOLLOWS, True)
    cls.prepare_data_loader = prepare_data_loader


def drawing_sampler(loader: Any) -> Any:
    """The sampler of a prepared loader that draws its order from a moving generator, or None.
    Accelerate puts the user's batch sampler inside its ``BatchSamplerShard`` on several processes."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None),
                    getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None)):
        if sampler is not None and draws_its_order(sampler):
            return sampler
    return None


class StatefulLoaders:
    """The stateful loaders among the prepared ones, as one :class:`bcp.ShardedDataloader`: each
    process's loaders' states (by the loader's position among every prepared dataloader) and the
    generator states their epochs' orders were drawn from are its DP index's part; on another number
    of processes each loader's state is resharded from all the saved processes'
    (:func:`bcp.integration.reshard_states`: accelerate deals the batches of one global order
    round-robin to the processes)."""

    def __init__(self, loaders: Sequence[Any], *, process: int = 0, processes: int = 1) -> None:
        self.loaders = {str(i): loader for i, loader in enumerate(loaders) if is_stateful(loader)}
        self.process, self.processes = process, processes

    def replicated_state(self) -> None:
        return None

    def sharded_states(self) -> list[dict[str, Any]]:
        states = {index: loader.state_dict() for index, loader in self.loaders.items()}
        draws = {}
        for index, loader in self.loaders.items():
            if (draw := _epoch_draw(index, loader, states[index])) is not None:
                draws[index] = draw
        return [{"loaders": states, "drawn_from": draws}]

    @staticmethod
    def assign_parts(saved: list[bcp.PartKey], dp_size: int) -> list[list[bcp.PartKey]]:
        """Every process reads every saved process's states: a change of their number needs them all."""
        return [list(saved) for _ in range(dp_size)]

    def load_dataloader_state(self, replicated: Any, sharded: list[dict[str, Any]]) -> None:
        parts = [part if "loaders" in part else {"loaders": part, "drawn_from": {}} for part in sharded]
        saved = [part["loaders"] for part in parts]
        if sorted(saved[0]) != sorted(self.loaders):
            raise MismatchError(f"stateful dataloaders at positions {sorted(saved[0])} were saved, the accelerator "
                                f"has them at {sorted(self.loaders)}", key=DATALOADER_COMPONENT)
        states = {index: reshard_states([states[index] for states in saved], self.process, self.processes)
                  for index in self.loaders}
        draws = {index: _saved_draw(index, [part["drawn_from"].get(index) for part in parts],
                                    self.process if len(parts) == self.processes else None)
                 for index in self.loaders}
        for index, loader in self.loaders.items():
            sampler = drawing_sampler(loader)
            if draws[index] is not None and sampler is None:
                raise MismatchError(f"stateful dataloader {index} was saved with an order drawn from a generator "
                                    "(shuffle=True) and the live one draws none", key=DATALOADER_COMPONENT)
            loader.load_state_dict(states[index])
            if draws[index] is not None:
                replay_order(sampler, draws[index])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The states of a checkpoint that saved them as one ``state_dict`` per process."""
        self.load_dataloader_state(None, [state] * self.processes)


def _epoch_draw(index: str, loader: Any, state: dict[str, Any]) -> torch.Tensor | None:
    """The generator state the loader's epoch order was drawn from, where a resume needs it: a
    shuffled loader mid-epoch. Refused where bcp did not see the draw."""
    sampler = drawing_sampler(loader)
    if sampler is None or state.get("_iterator_finished") or not batches_yielded(state):
        return None  # in order, or a resume starts a new epoch: nothing of the old order is left to walk
    draw = drawn_from(sampler)
    if draw is None:
        follow_order(sampler)  # from its next epoch on
        raise CheckpointError(
            f"stateful dataloader {index}: its {type(sampler).__name__} drew this epoch's order from its generator "
            "before bcp followed it (the loader was prepared before bcp_accelerate was installed), and the generator "
            "has moved on since, so a resume could not walk the same order; enable bcp (ACCELERATE_CHECKPOINT_ENGINE="
            "bcp, or bcp_accelerate.enable) before accelerator.prepare()", key=DATALOADER_COMPONENT)
    return draw


def _saved_draw(index: str, draws: list[torch.Tensor | None], process: int | None) -> torch.Tensor | None:
    """The draw this process replays: its own on the same number of processes; otherwise the one
    every saved process shares (accelerate keeps the generators in step)."""
    if process is not None:
        return draws[process]
    if any(d is None for d in draws) and any(d is not None for d in draws) \
            or any(not torch.equal(d, draws[0]) for d in draws if d is not None):
        raise MismatchError(f"stateful dataloader {index}: the saved processes drew their epoch orders from different "
                            "generator states, so there is no one global order to continue on another number of "
                            "processes", key=DATALOADER_COMPONENT)
    return draws[0]


def component(accelerator: Any) -> dict[str, bcp.DataloaderState]:
    """``{"dataloader": ...}`` when the accelerator has stateful dataloaders, else nothing. Every
    process is a DP rank (accelerate's data parallelism) and writes its own part."""
    loaders = StatefulLoaders(accelerator._dataloaders, process=accelerator.process_index,
                              processes=accelerator.num_processes)
    if not loaders.loaders:
        return {}
    return {DATALOADER_COMPONENT: bcp.DataloaderState(loaders, dp_rank=accelerator.process_index,
                                                      dp_size=accelerator.num_processes)}


class SamplerOnly:
    """A stateful dataloader as accelerate's own files see it when bcp holds its state."""

    use_stateful_dataloader = False

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def for_accelerate_files(loaders: Sequence[Any], in_bcp: bool) -> list[Any]:
    """The loaders to hand accelerate's own save/load: stateful ones as :class:`SamplerOnly` when
    bcp holds their state."""
    return [SamplerOnly(loader) if in_bcp and is_stateful(loader) else loader for loader in loaders]
