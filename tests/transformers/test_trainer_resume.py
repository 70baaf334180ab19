"""The Trainer's checkpoints through bcp on real gloo processes: a tiny GPT-2 saved at step 6 of a
12-step epoch on 2 processes resumes on 2 with the uninterrupted run's losses, and on 1 and 3 with
the saved weights, optimizer, scheduler and step and every sample of the epoch trained once."""

from __future__ import annotations

import os

import pytest
from transformers.trainer_utils import get_last_checkpoint

from trainer_helpers import SAMPLES, SAVED_AT, assert_same_state, assert_same_weights, fit

TRAINED_BEFORE_SAVE = SAVED_AT * 4  # batches of 4 on each process


@pytest.fixture(scope="module")
def uninterrupted(ranks, tmp_path_factory):
    """2 processes, through bcp by the environment variable, saving at steps 6 and 12."""
    output = str(tmp_path_factory.mktemp("trainer") / "uninterrupted")
    return output, ranks(2).run(fit, output)


def samples_before_save(run: list[dict]) -> list[int]:
    return [index for rank in run for index in rank["seen"][:TRAINED_BEFORE_SAVE]]


def test_checkpoint_folders_keep_the_trainers_conventions(uninterrupted):
    output, _ = uninterrupted
    assert get_last_checkpoint(output) == os.path.join(output, "checkpoint-12")
    names = set(os.listdir(os.path.join(output, f"checkpoint-{SAVED_AT}")))
    assert "trainer_state.json" in names and "gen-00000001" in names
    assert not names & {"model.safetensors", "optimizer.pt", "rng_state_0.pth"}


def test_resume_on_two_processes_repeats_the_uninterrupted_losses(ranks, uninterrupted, tmp_path):
    output, run = uninterrupted
    resumed = ranks(2).run(fit, str(tmp_path), "bcp", os.path.join(output, f"checkpoint-{SAVED_AT}"))
    for rank, rank_run in zip(resumed, run):
        assert_same_state(rank["at_start"], rank_run["at_save"][SAVED_AT])
        assert rank["losses"] == {step: loss for step, loss in rank_run["losses"].items() if step > SAVED_AT}
        assert_same_state(rank["end"], rank_run["end"])


@pytest.mark.parametrize("processes, steps_after", [(1, 12), (3, 4)])
def test_resume_on_another_number_of_processes_trains_every_sample_once(ranks, uninterrupted, tmp_path, processes,
                                                                         steps_after):
    output, run = uninterrupted
    resumed = ranks(processes).run(fit, str(tmp_path), "bcp", os.path.join(output, f"checkpoint-{SAVED_AT}"))
    for rank in resumed:
        assert_same_state(rank["at_start"], run[0]["at_save"][SAVED_AT])
        assert rank["end"]["step"] == SAVED_AT + steps_after
    after = [index for rank in resumed for index in rank["seen"]]
    assert sorted(samples_before_save(run) + after) == list(range(SAMPLES))


def test_resume_true_takes_the_newest_folder_and_rotation_keeps_the_limit(ranks, tmp_path):
    first = ranks(2).run(fit, str(tmp_path), "bcp", None, {"max_steps": SAVED_AT, "save_total_limit": 1})
    again = ranks(2).run(fit, str(tmp_path), "bcp", True, {"save_total_limit": 1})
    assert_same_state(again[0]["at_start"], first[0]["end"])
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-12"]


def test_a_checkpoint_of_the_trainers_own_engine_resumes_on_as_many_processes(ranks, tmp_path):
    own = ranks(2).run(fit, str(tmp_path), "transformers", None, {"max_steps": SAVED_AT})
    checkpoint = os.path.join(tmp_path, f"checkpoint-{SAVED_AT}")
    assert "optimizer.pt" in os.listdir(checkpoint)
    resumed = ranks(2).run(fit, str(tmp_path / "resumed"), "bcp", checkpoint)
    assert_same_state(resumed[0]["at_start"], own[0]["end"])
    assert resumed[0]["end"]["step"] == 2 * SAVED_AT
    with pytest.raises(AssertionError, match="resume it on 2 processes, or set ignore_data_skip=True"):
        ranks(1).run(fit, str(tmp_path / "elsewhere"), "bcp", checkpoint)


def test_load_best_model_at_end_loads_the_best_bcp_checkpoint(ranks, tmp_path):
    # The highest evaluation loss is "best" here, so that the best step is an early one, not the last.
    arguments = {"eval_strategy": "steps", "eval_steps": 3, "save_steps": 3, "load_best_model_at_end": True,
                 "metric_for_best_model": "loss", "greater_is_better": True}
    run = ranks(2).run(fit, str(tmp_path), "bcp", None, arguments)
    best = run[0]["best_step"]
    assert best < 12
    assert_same_weights(run[0]["end"]["model"], run[0]["at_save"][best]["model"])
