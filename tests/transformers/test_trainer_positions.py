"""The position in the data, in one process: samples consumed from a save's epoch progress, and
the batches a resume on another layout skips, or its refusal where the samples end inside a step."""

from __future__ import annotations

import pytest

import bcp
from bcp_transformers.positions import Position, at_save, batches_to_skip


def test_the_position_counts_the_samples_of_every_process():
    assert at_save(0, 6 / 12, 12, processes=2, batch_size=4) == Position(0, 48)
    assert at_save(1, 2.0, 12, processes=2, batch_size=4) == Position(2, 0)


@pytest.mark.parametrize("processes, skipped", [(1, 12), (2, 6), (3, 4), (4, 3)])
def test_a_resume_skips_the_batches_that_hold_exactly_the_samples_trained(processes, skipped):
    assert batches_to_skip(Position(0, 48), processes, 4, 1, "ckpt") == skipped


def test_samples_that_end_inside_an_optimizer_step_are_refused_with_what_to_do():
    with pytest.raises(bcp.CheckpointError, match=r"48 samples of epoch 0.*5 processes x batch 4.*ignore_data_skip"):
        batches_to_skip(Position(0, 48), 5, 4, 1, "ckpt")
    with pytest.raises(bcp.CheckpointError, match="4 accumulation steps"):
        batches_to_skip(Position(0, 48), 2, 4, 4, "ckpt")
