"""Where in its data a training run is, counted in samples so that any number of processes resumes it.

The Trainer's loader shuffles with a seeded sampler whose order of an epoch does not depend on the
number of processes, cuts it into batches of the per-device size and deals them to the processes in
turn. After ``b`` batches on each of ``n`` processes the run has therefore consumed the first
``b * n * batch_size`` samples of the epoch's order, whatever ``n`` is. The Trainer's engine records
only ``global_step`` and skips that many steps' batches on resume, which is right for the same
number of processes and skips too few or too many samples for another. This position records the
samples, and the resume skips the batches that hold exactly them on the processes it has now,
through the Trainer's own ``skip_first_batches``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from bcp import CheckpointError


@dataclass(frozen=True)
class Position:
    """``samples`` consumed from epoch ``epoch``'s order (an epoch finished is the next one at 0)."""

    epoch: int
    samples: int

    def as_value(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def of_value(cls, value: dict[str, Any]) -> "Position":
        return cls(epoch=int(value["epoch"]), samples=int(value["samples"]))


def at_save(epoch: int, epoch_progress: float, batches_in_epoch: int, processes: int, batch_size: int) -> Position:
    """The position after ``epoch_progress`` (the Trainer's ``state.epoch``) in an epoch of
    ``batches_in_epoch`` batches per process."""
    batches = round((epoch_progress - epoch) * batches_in_epoch)  # (step + 1) / steps_in_epoch, as the Trainer sets it
    if batches >= batches_in_epoch:
        return Position(epoch + 1, 0)
    return Position(epoch, batches * processes * batch_size)


def batches_to_skip(position: Position, processes: int, batch_size: int, accumulation: int, checkpoint: str) -> int:
    """The batches each of ``processes`` skips in ``position.epoch`` to continue after exactly
    ``position.samples``; a position that falls inside an optimizer step of this layout is refused."""
    per_step = processes * batch_size * accumulation
    if position.samples % per_step:
        raise CheckpointError(
            f"the checkpoint was saved after {position.samples} samples of epoch {position.epoch}, which is not a "
            f"whole number of optimizer steps of {per_step} samples ({processes} processes x batch {batch_size} x "
            f"{accumulation} accumulation steps): resume on a number of processes that divides it, or set "
            "ignore_data_skip=True to start the epoch over", path=checkpoint)
    return position.samples // (processes * batch_size)
