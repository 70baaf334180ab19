"""A resume from nothing is refused before any training, in the Trainer's own words (which scripts
and transformers' own tests match) and with bcp's error classes."""

from __future__ import annotations

import pytest

import bcp
from trainer_helpers import fit


def test_resume_true_without_any_checkpoint_folder_is_refused_in_the_trainers_words(tmp_path):
    with pytest.raises(bcp.CheckpointNotFoundError, match="No valid checkpoint found in output directory"):
        fit(str(tmp_path), "bcp", True)


def test_a_path_holding_no_checkpoint_is_refused_in_the_trainers_words(tmp_path):
    with pytest.raises(bcp.CheckpointNotFoundError, match="Can't find a valid checkpoint at this path"):
        fit(str(tmp_path), "bcp", str(tmp_path / "checkpoint-5-bogus"))


def test_a_save_that_never_committed_is_refused_as_such(tmp_path):
    interrupted = tmp_path / "checkpoint-6"
    (interrupted / "gen-00000001").mkdir(parents=True)
    with pytest.raises(bcp.CheckpointNotCommittedError, match="no whole checkpoint"):
        fit(str(tmp_path), "bcp", str(interrupted))
