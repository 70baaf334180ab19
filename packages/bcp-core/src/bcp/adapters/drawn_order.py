"""Epoch orders drawn from a moving ``torch.Generator``, known by the state they were drawn from.

A ``RandomSampler`` draws its epoch's permutation from its ``generator`` each time it is iterated,
and the generator moves on. A loader restored from a checkpoint iterates its sampler again (once or
twice while it rebuilds its iterator), so it walks a permutation drawn from wherever the generator
stands then: samples are skipped and repeated. Here a sampler whose order is drawn that way is
*followed*: each iteration records the generator's state right before the draw
(:func:`drawn_from`), which, with how much of the epoch the trainer consumed, is the position; a
resume *replays* it (:func:`replay`): every iteration of the resumed epoch sets the generator to
that state before drawing, so it draws the saved permutation again and leaves the generator where
the uninterrupted run left it (later epochs draw what they would have drawn).

The replay lasts until the sampler is set to another epoch (``set_epoch``, which Lightning's and
Accelerate's loops call at every epoch start, the resumed one included). Following changes the
sampler's class to a subclass of its own (``isinstance`` still holds; it pickles as its own class).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

#: Samplers whose iteration draws its order from ``self.generator`` at its start, and nothing after.
_DRAWING: tuple[type, ...] = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
try:
    from torchdata.stateful_dataloader.sampler import RandomSampler as _TorchdataRandomSampler

    _DRAWING += (_TorchdataRandomSampler,)
except ImportError:  # torchdata is optional
    pass

#: Each followed sampler class's subclass (a sampler's class is swapped for it: a mixin base would
#: change the instance layout, which ``__class__`` assignment refuses).
_FOLLOWING: dict[type, type] = {}


def draws_its_order(sampler: Any) -> bool:
    """Whether ``sampler`` draws each iteration's order from a moving ``generator`` bcp can follow.
    A sampler that reseeds its generator from its epoch when iterated (accelerate's
    ``SeedableRandomSampler``) does not: its order is a pure function of its seed and epoch."""
    return _is_followed(sampler) or isinstance(sampler, _DRAWING) and not callable(getattr(sampler, "set_epoch", None))


def follow(sampler: Any) -> None:
    """Make ``sampler`` record its generator's state before each draw (idempotent)."""
    if _is_followed(sampler):
        return
    cls = type(sampler)
    if cls not in _FOLLOWING:
        _FOLLOWING[cls] = type(cls.__name__, (cls,), {
            "__module__": cls.__module__, "_bcp_base": cls, "__iter__": _iter, "set_epoch": _set_epoch,
            "__reduce_ex__": _reduce_ex})
    sampler.__class__ = _FOLLOWING[cls]
    sampler._bcp_drawn_from, sampler._bcp_replay, sampler._bcp_replay_epoch = None, None, None


def drawn_from(sampler: Any) -> torch.Tensor | None:
    """The generator state the order of ``sampler``'s latest iteration was drawn from (None: it has
    not been iterated since it was followed)."""
    return getattr(sampler, "_bcp_drawn_from", None)


def replay(sampler: Any, state: torch.Tensor) -> None:
    """Make the iterations of ``sampler`` draw from ``state`` until it is set to another epoch than
    the first one it is set to after this call."""
    follow(sampler)
    sampler._bcp_replay, sampler._bcp_replay_epoch = state.clone(), None


def redraw(sampler: Any, state: torch.Tensor) -> list[int]:
    """The order ``sampler`` draws when its generator starts from ``state`` (its own iteration, run to
    its end, so the generator then stands where the epoch that drew from ``state`` left it)."""
    generator = getattr(sampler, "generator", None)
    if generator is None:
        generator = sampler.generator = torch.Generator()
    generator.set_state(state)
    if _is_followed(sampler):
        sampler._bcp_drawn_from, sampler._bcp_replay = state.clone(), None
    base = getattr(type(sampler), "_bcp_base", type(sampler))
    return [int(i) for i in base.__iter__(sampler)]


def _is_followed(sampler: Any) -> bool:
    return type(sampler) in _FOLLOWING.values()


# The methods of a followed sampler's class.

def _iter(self: Any) -> Any:
    generator = self.generator
    if self._bcp_replay is not None:
        if generator is None:  # torch's samplers then draw a seed from the global RNG: give it its own
            self.generator = generator = torch.Generator()
        generator.set_state(self._bcp_replay)
    self._bcp_drawn_from = None if generator is None else generator.get_state()
    # torch's samplers draw at the first next() of this iterator, which the loader's batch sampler
    # makes right away: nothing draws from the generator in between
    return self._bcp_base.__iter__(self)


def _set_epoch(self: Any, epoch: int) -> None:
    if self._bcp_replay is not None:
        if self._bcp_replay_epoch is None:
            self._bcp_replay_epoch = epoch
        elif epoch != self._bcp_replay_epoch:
            self._bcp_replay, self._bcp_replay_epoch = None, None


def _reduce_ex(self: Any, protocol: Any) -> Any:
    """Pickled as the sampler it follows: the recording is this process's."""
    state = {k: v for k, v in self.__dict__.items() if not k.startswith("_bcp_")}
    return _unfollowed, (self._bcp_base, state)


def _unfollowed(cls: type, state: dict[str, Any]) -> Any:
    sampler = cls.__new__(cls)
    sampler.__dict__.update(state)
    return sampler
