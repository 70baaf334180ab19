"""The Trainer with accelerate's FSDP2 plugin on 2 gloo processes (DTensor parameters and
optimizer state): saved at step 6, resumed on 2 FSDP2 processes and on 1 plain process with the
saved weights, optimizer, scheduler and step, bitwise."""

from __future__ import annotations

import os

import pytest

from trainer_helpers import SAVED_AT, assert_same_state, fit

FSDP2 = {"fsdp": True, "fsdp_config": {"version": 2}}


@pytest.fixture(scope="module")
def fsdp2_run(ranks, tmp_path_factory):
    output = str(tmp_path_factory.mktemp("trainer-fsdp2"))
    return output, ranks(2).run(fit, output, "bcp", None, {**FSDP2, "max_steps": SAVED_AT})


def test_fsdp2_resumes_on_two_fsdp2_processes(ranks, fsdp2_run, tmp_path):
    output, run = fsdp2_run
    resumed = ranks(2).run(fit, str(tmp_path), "bcp", os.path.join(output, f"checkpoint-{SAVED_AT}"),
                           {**FSDP2, "max_steps": 2 * SAVED_AT})
    assert_same_state(resumed[0]["at_start"], run[0]["end"])


def test_fsdp2_resumes_on_one_plain_process(ranks, fsdp2_run, tmp_path):
    output, run = fsdp2_run
    resumed = ranks(1).run(fit, str(tmp_path), "bcp", os.path.join(output, f"checkpoint-{SAVED_AT}"),
                           {"max_steps": 2 * SAVED_AT})
    assert_same_state(resumed[0]["at_start"], run[0]["end"])
