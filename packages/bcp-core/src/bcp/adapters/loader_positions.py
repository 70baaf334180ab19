"""A loader's saved position as one typed record, and the steps of a resume that every integration
takes alike; an integration supplies only its accessors (which sampler walks the epoch, which draws
it, its batch sampler, how it sets the epoch).

What a checkpoint holds per rank and loader is one of two shapes, and :meth:`SavedPosition.read`
reads both:

- version 1, a position (``bcp.adapters.epoch_positions.position``'s dict, plus ``"resumed"``:
  whether the rank walked a resumed epoch's share), saved as it is;
- version 0, from checkpoints saved before positions: the generator state a shuffled loader's order
  was drawn from, alone (``drawn_from``). Its epoch is unknown (None) and it never finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from bcp.adapters.dataloader import COMPONENT
from bcp.adapters.distributed_sampler import loaders_own_batch_sampler
from bcp.adapters.drawn_order import follow, replay
from bcp.adapters.epoch_positions import restore_generator
from bcp.errors import CheckpointError, MismatchError
from bcp.torch_internals.dataloader import state_batches_yielded, state_finished

#: The version of the records :meth:`SavedPosition.read` makes of the current shape.
POSITION_VERSION = 1


@dataclass(frozen=True, slots=True)
class SavedPosition:
    """A rank's saved position in a loader's epoch."""

    #: 1: a position; 0: a draw alone, saved before positions.
    version: int
    #: The epoch the rank walked (None: unknown, or a sampler without epochs).
    epoch: int | None
    #: Whether the rank's walk of the epoch was over.
    finished: bool
    #: Whether the rank walked a resumed epoch's share rather than its own.
    resumed: bool
    #: The order the epoch walks (``bcp.adapters.epoch_order``'s spec; None: unknown).
    order: dict[str, Any] | None
    #: Where the drawing sampler's generator stood at the save (None: none, or unknown).
    generator: bytes | None
    #: The position as saved (what ``plan_resume`` and a resumed epoch's record take); None for version 0.
    saved: dict[str, Any] | None

    @classmethod
    def read(cls, saved: dict[str, Any] | None, drawn_from: torch.Tensor | None = None) -> "SavedPosition | None":
        """The record of a saved position, else of a draw saved alone (``drawn_from``), else None."""
        if saved is not None:
            return cls(POSITION_VERSION, saved.get("epoch"), bool(saved["finished"]), bool(saved.get("resumed", False)),
                       saved["order"], saved.get("generator"), saved)
        if drawn_from is not None:
            order = {"kind": "drawn", "generator": drawn_from.numpy().tobytes()}
            return cls(0, None, False, False, order, None, None)
        return None

    def next_epoch(self) -> int | None:
        """The epoch the loader walks first after a resume of its own state (the next one where it was over)."""
        return None if self.epoch is None else self.epoch + int(self.finished)

    def drawn_generator(self) -> bytes | None:
        """The generator state the epoch's order was drawn from, where a sampler drew it."""
        order = self.order
        while order is not None and order["kind"] == "through":
            order = order["inner"]
        return order["generator"] if order is not None and order["kind"] == "drawn" else None


def batching_of(batch_sampler: Any) -> tuple[int | None, bool]:
    """The batch size and drop_last of a loader's batch sampler where it is torch's or torchdata's
    (None, False: a custom one, whose batches hold what it chooses)."""
    if not loaders_own_batch_sampler(batch_sampler):
        return None, False
    return batch_sampler.batch_size, bool(batch_sampler.drop_last)


def consumed_batches(state: Any) -> tuple[int, bool] | None:
    """The batches a StatefulDataLoader's ``state`` had yielded in its epoch and whether the epoch was
    over; None for another loader's state."""
    try:
        return state_batches_yielded(state), state_finished(state)
    except (KeyError, TypeError):
        return None


def refuse_unfollowed_draw(drawing: Any, consumed: int, finished: bool, *, loader: str, cause: str,
                           remedy: str) -> None:
    """A position without a known order: refused where ``drawing`` drew this epoch's order before bcp
    followed it and the epoch is under way (a resume could not walk the same order), the sampler
    followed from its next epoch on; else the loader saves its own state alone. ``loader`` names the
    loader, ``cause`` why it was not followed (may be empty), ``remedy`` how to follow it in time."""
    if drawing is not None and consumed and not finished:
        follow(drawing)
        raise CheckpointError(
            f"{loader}: its {type(drawing).__name__} drew this epoch's order from its generator before bcp followed "
            f"it{cause}, and the generator has moved on since, so a resume could not walk the same order; {remedy}",
            key=COMPONENT)


def continue_own(position: SavedPosition, drawing: Any, set_epoch: Callable[[int | None], None], *,
                 loader: str) -> None:
    """A loader continues its own saved state: ``set_epoch`` gets the epoch it walks first (None:
    unknown), and its drawing sampler replays the saved draw, or, where the epoch was over, its
    generator stands where the saved one stood (the next epoch's draw is the uninterrupted run's)."""
    set_epoch(position.next_epoch())
    if position.finished:
        restore_generator(drawing, position.generator)
        return
    draw = position.drawn_generator()
    if draw is not None:
        if drawing is None:
            raise MismatchError(f"a {loader} was saved with an order drawn from a generator (shuffle=True) and the "
                                "live one draws none", key=COMPONENT)
        replay(drawing, torch.frombuffer(bytearray(draw), dtype=torch.uint8))
