"""The Trainer with FSDP on 2 gloo processes, as its ``fsdp`` and ``fsdp_config`` arguments
configure accelerate's plugin: FSDP1 (``version: 1``, flat parameters with ``use_orig_params``,
the Trainer's default ``FULL_STATE_DICT``) and FSDP2 (``version: 2``, DTensor parameters and
optimizer state). Saved at step 6, each resumes on 2 processes of the same FSDP and on 1 plain
process with the saved weights, optimizer, scheduler and step, bitwise. On the CPU the accelerator
is set to FSDP by ``trainer_helpers.on_fsdp`` (accelerate selects FSDP only on accelerators)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from trainer_helpers import SAVED_AT, assert_same_state, fit

FSDP1_PREFIX = "_fsdp_wrapped_module."


def fsdp(version: int) -> dict:
    # FSDP1's sync_module_states (the Trainer's default) broadcasts from an accelerator device, which
    # accelerate's plugin refuses to set up without one; every rank builds the same model here anyway.
    cpu = {"sync_module_states": False} if version == 1 else {}
    return {"fsdp": True, "fsdp_config": {"version": version, **cpu}}


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def fsdp_run(request, ranks, tmp_path_factory):
    output = str(tmp_path_factory.mktemp(f"trainer-fsdp{request.param}"))
    return request.param, output, ranks(2).run(fit, output, "bcp", None, {**fsdp(request.param), "max_steps": SAVED_AT})


def test_fsdp_resumes_on_two_processes_of_the_same_fsdp(ranks, fsdp_run, tmp_path):
    version, output, run = fsdp_run
    resumed = ranks(2).run(fit, str(tmp_path), "bcp", os.path.join(output, f"checkpoint-{SAVED_AT}"),
                           {**fsdp(version), "max_steps": 2 * SAVED_AT})
    for rank, saved in zip(resumed, run):
        assert_same_state(without_empty_fsdp1_shards(rank["at_start"], saved["end"]), saved["end"])


def test_fsdp_resumes_on_one_plain_process(ranks, fsdp_run, tmp_path):
    version, output, run = fsdp_run
    resumed = ranks(1).run(fit, str(tmp_path), "bcp", os.path.join(output, f"checkpoint-{SAVED_AT}"),
                           {"max_steps": 2 * SAVED_AT})
    expected = run[0]["end"] if version == 2 else {**run[0]["end"], "optimizer": whole_fsdp1_optimizer(run)}
    flat = resumed[0]["at_start"] if version == 2 else {**resumed[0]["at_start"], "optimizer": {
        name: {key: value.flatten() if key != "step" else value for key, value in state.items()}
        for name, state in resumed[0]["at_start"]["optimizer"].items()}}
    assert_same_state(flat, expected)


def without_empty_fsdp1_shards(resumed: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """A running FSDP1 optimizer has no state for a parameter whose shard on this rank is empty (it
    never gets a gradient there); after bcp's load it has state of zero elements, dropped here."""
    extra = set(resumed["optimizer"]) - set(saved["optimizer"])
    assert all(value.numel() == 0 for name in extra for key, value in resumed["optimizer"][name].items()
               if key != "step"), extra
    return {**resumed, "optimizer": {name: state for name, state in resumed["optimizer"].items() if name not in extra}}


def whole_fsdp1_optimizer(run: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The optimizer state of the plain model, flattened, from FSDP1's per-rank shards: each rank
    holds a contiguous piece of each parameter's flattened state, in rank order."""
    whole: dict[str, dict[str, Any]] = {}
    for rank in run:
        for name, state in rank["end"]["optimizer"].items():
            target = whole.setdefault(name.replace(FSDP1_PREFIX, ""), {})
            for key, value in state.items():
                target[key] = value if key == "step" else torch.cat([target.get(key, value[:0]), value])
    return whole
