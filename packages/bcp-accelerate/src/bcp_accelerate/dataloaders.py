"""The accelerator's stateful dataloaders (``DataLoaderConfiguration(use_stateful_dataloader=True)``)
as bcp's ``dataloader`` component, resumed on any number of processes.

Each process saves, per stateful prepared loader, the loader's ``state_dict()`` (accelerate would
``torch.save`` every process's into one shared file name) and its *position*
(``bcp.integration.loader_position``): the epoch's order (the user's sampler: in order, seeded per
epoch by ``use_seedable_sampler``, or drawn from its generator), the batches accelerate deals this
process (every ``num_processes``-th of the order's batches) and how many its loop consumed.

- On the same number of processes each loader gets its own state back, at its saved epoch (accelerate's
  own load does not restore a loader's count of epochs, from which a seedable sampler seeds each
  epoch's order) and, shuffled, with the draw of the saved epoch replayed.
- On another number, the samples not yet consumed are dealt to the processes, sample by sample, and
  each loader delivers its share of the rest of the epoch (the last batch short where the share is not
  whole; every process the same number of batches), then its own order again.

A shuffled loader (``shuffle=True``, a ``RandomSampler``) draws each epoch's permutation from its
generator, which moves on as it is drawn from (accelerate keeps it in step across processes): bcp
follows the sampler from ``prepare()`` on (``accelerate_patch``), so a save knows the generator state
the epoch's permutation was drawn from. A save of a shuffled loader whose draw bcp did not see is refused.

Accelerate's own files still hold the rest of each loader (a seedable sampler): the loaders are
handed to it as :class:`SamplerOnly`, which tells it their state is not its to save or load.
"""

from __future__ import annotations

from typing import Any, Sequence

import bcp
from bcp import MismatchError
from bcp.integration import DATALOADER_COMPONENT
from bcp.integration import (SavedPosition, Walk, batching_of, consumed_batches, continue_own, deliver_resume,
                             draws_its_order, follow_order, loader_position, order_of_sampler, plan_resume,
                             rebuild_order, refuse_unfollowed_draw, resumed_epoch_of, unwrap_resumed)
from bcp_accelerate import accelerate_patch


def is_stateful(loader: Any) -> bool:
    return bool(getattr(loader, "use_stateful_dataloader", False))


def install() -> None:
    """Follow the order drawn by every dataloader ``Accelerator.prepare`` gets from now on (idempotent)."""
    accelerate_patch.install(_follow)


def _follow(loader: Any) -> None:
    if (sampler := drawing_sampler(loader)) is not None:
        follow_order(sampler)


def drawing_sampler(loader: Any) -> Any:
    """The sampler of a loader (prepared or not) that draws its order from a moving generator, or None."""
    batch_sampler = accelerate_patch.user_batch_sampler(loader)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        sampler = unwrap_resumed(sampler)
        if sampler is not None and draws_its_order(sampler):
            return sampler
    return None


class StatefulLoaders:
    """The stateful loaders among the prepared ones, as one :class:`bcp.ShardedDataloader`: each
    process's loaders' states and positions (by the loader's place among every prepared dataloader)
    are its DP index's part."""

    def __init__(self, loaders: Sequence[Any], *, process: int = 0, processes: int = 1) -> None:
        self.loaders = {str(i): loader for i, loader in enumerate(loaders) if is_stateful(loader)}
        self.process, self.processes = process, processes

    def replicated_state(self) -> None:
        return None

    def sharded_states(self) -> list[dict[str, Any]]:
        states = {index: loader.state_dict() for index, loader in self.loaders.items()}
        positions = {index: _position(index, loader, states[index]) for index, loader in self.loaders.items()}
        return [{"loaders": states, "positions": {i: p for i, p in positions.items() if p is not None}}]

    @staticmethod
    def assign_parts(saved: list[bcp.PartKey], dp_size: int) -> list[list[bcp.PartKey]]:
        """Every process reads every saved process's states: a change of their number needs them all."""
        return [list(saved) for _ in range(dp_size)]

    def load_dataloader_state(self, replicated: Any, sharded: list[dict[str, Any]]) -> None:
        parts = [part if "loaders" in part else {"loaders": part} for part in sharded]
        if sorted(parts[0]["loaders"]) != sorted(self.loaders):
            raise MismatchError(f"stateful dataloaders at positions {sorted(parts[0]['loaders'])} were saved, the "
                                f"accelerator has them at {sorted(self.loaders)}", key=DATALOADER_COMPONENT)
        for index, loader in self.loaders.items():
            self._resume(index, loader, parts)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The states of a checkpoint that saved them as one ``state_dict`` per process."""
        self.load_dataloader_state(None, [state] * self.processes)

    def _resume(self, index: str, loader: Any, parts: list[dict[str, Any]]) -> None:
        positions = [SavedPosition.read(part.get("positions", {}).get(index), part.get("drawn_from", {}).get(index))
                     for part in parts]
        if len(parts) == self.processes:
            own = positions[self.process]
            if own is None or not own.resumed:
                _resume_own(loader, parts[self.process]["loaders"][index], own)
                return
        if any(p is None or p.saved is None for p in positions):
            raise MismatchError(
                f"stateful dataloader {index} was saved on {len(parts)} processes and is loaded on {self.processes}: "
                "its state is a position within each process's own share that bcp cannot follow (an iterable "
                "dataset, accelerate's split_batches, or a sampler other than a sequential, random or seedable one), "
                "so the rest of its epoch cannot be dealt to another number of processes", key=DATALOADER_COMPONENT)
        batch_size, drop_last = _batching(loader)
        saved = [p.saved for p in positions]
        resumes = [plan_resume(saved, self.processes, process, batch_size=batch_size, batch_drop_last=drop_last,
                               drop=drop_last) for process in range(self.processes)]
        mine = resumes[self.process]
        loader.load_state_dict({})
        accelerate_patch.set_loader_epoch(loader, mine.next_epoch() or 0)
        drawing = drawing_sampler(loader)
        if mine.finished or accelerate_patch.shard(loader) is None:
            deliver_resume(loader, mine, drawing, record=saved[0])
        else:
            _deal_batches(loader, resumes, drawing, batch_size, drop_last, record=saved[0])


def _resume_own(loader: Any, state: dict[str, Any], position: SavedPosition | None) -> None:
    """The loader's own state, at the saved epoch (the next one where it was over; the first, 0, where
    the checkpoint does not say) and draw."""
    if position is None:
        loader.load_state_dict(state)
        return
    loader.load_state_dict({} if position.finished else state)
    continue_own(position, drawing_sampler(loader),
                 lambda epoch: accelerate_patch.set_loader_epoch(loader, epoch or 0), loader="stateful dataloader")


def _deal_batches(loader: Any, resumes: list[Any], drawing: Any, batch_size: int, drop_last: bool, *,
                  record: dict[str, Any]) -> None:
    """Give the loader's shard the rest of the epoch as every process's batches in its round-robin
    order (each process builds them all: they are the same everywhere)."""
    mine = resumes[accelerate_patch.shard(loader).process_index]
    order = rebuild_order(mine.order, drawing)
    per_process = [_cut(resume.walk.indices(order, resume.length), batch_size, drop_last) for resume in resumes]
    interleaved = [batches[k] for k in range(len(per_process[0])) for batches in per_process]
    accelerate_patch.ResumedBatches(loader, interleaved, mine.walk, record, mine.epoch)


def _cut(indices: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    batches = [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]
    return batches[:-1] if drop_last and batches and len(batches[-1]) < batch_size else batches


def _position(index: str, loader: Any, state: dict[str, Any]) -> dict[str, Any] | None:
    """This process's position in the loader's epoch, or None where bcp cannot follow it."""
    batch_size, drop_last = _batching(loader)
    dealt = accelerate_patch.shard(loader)
    if batch_size is None or (dealt is not None and dealt.split_batches):
        return None
    user = accelerate_patch.user_batch_sampler(loader)
    sampler, drawing = unwrap_resumed(user.sampler), drawing_sampler(loader)
    epoch = accelerate_patch.loader_epoch(loader)
    seed = accelerate_patch.seeded_order(sampler)
    order = order_of_sampler(sampler) if seed is None else {"kind": "permutation", "size": len(sampler),
                                                             "seed": seed + epoch}
    counts = consumed_batches(state)
    if counts is None:
        return None  # not a StatefulDataLoader's state: its own state alone
    consumed, finished = counts
    resumed = accelerate_patch.resumed_batches(loader) or resumed_epoch_of(loader)
    if order is None and resumed is None:
        refuse_unfollowed_draw(drawing, consumed, finished, loader=f"stateful dataloader {index}",
                               cause=" (the loader was prepared before bcp_accelerate was installed)",
                               remedy="enable bcp (ACCELERATE_CHECKPOINT_ENGINE=bcp, or bcp_accelerate.enable) before "
                                      "accelerator.prepare()")
        return None  # an order bcp cannot rebuild (an iterable dataset, another sampler): its own state alone
    if resumed is not None:
        walk, consumed = resumed.walk, consumed * batch_size  # a resumed share is counted in samples
    elif dealt is not None:
        walk = Walk(dealt.num_processes, dealt.process_index, 0, len(dealt), unit=batch_size)
    else:
        walk = Walk(1, 0, 0, len(user), unit=batch_size)
    position = loader_position(loader, order, walk, consumed=consumed, finished=finished, epoch=epoch,
                               batch_size=batch_size, batch_drop_last=drop_last, drop=drop_last,
                               generator=getattr(drawing, "generator", None), current=resumed)
    if position is not None:
        position["resumed"] = resumed is not None
    return position


def _batching(loader: Any) -> tuple[int | None, bool]:
    """The batch size and drop_last of the user's batch sampler (None: a custom one)."""
    return batching_of(accelerate_patch.user_batch_sampler(loader))


def component(accelerator: Any) -> dict[str, bcp.DataloaderState]:
    """``{"dataloader": ...}`` when the accelerator has stateful dataloaders, else nothing. Every
    process is a DP rank (accelerate's data parallelism) and writes its own part."""
    loaders = StatefulLoaders(accelerate_patch.prepared(accelerator, "dataloaders"), process=accelerator.process_index,
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

    def get_sampler(self) -> Any:
        """The loader's sampler, not a resumed epoch standing in for it (accelerate pickles a seedable one)."""
        return unwrap_resumed(self._loader.get_sampler())

    def set_sampler(self, sampler: Any) -> None:
        """Accelerate's load gives a seedable sampler back: under a resumed epoch, to the sampler it stands in for."""
        current = resumed_epoch_of(self._loader)
        if current is not None:
            current.original = sampler
        else:
            self._loader.set_sampler(sampler)


def for_accelerate_files(loaders: Sequence[Any], in_bcp: bool) -> list[Any]:
    """The loaders to hand accelerate's own save/load: stateful ones as :class:`SamplerOnly` when
    bcp holds their state."""
    return [SamplerOnly(loader) if in_bcp and is_stateful(loader) else loader for loader in loaders]
