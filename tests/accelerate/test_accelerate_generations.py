"""``bcp_accelerate.enable(accelerator, keep_generations=N)``: ``save_state`` into one folder again
keeps the N newest committed generations with accelerate's files of each, and
``load_state(folder, generation=)`` resumes from an older one on 2 processes, bitwise; each
generation records the step it was saved at."""

from __future__ import annotations

import os

import pytest
import torch

import bcp
import bcp_accelerate
from accelerate_helpers import assert_restored, build, scramble_rng, session, snapshot, train
from bcp.integration import checkpoint_location, open_checkpoint
from models import assert_bitwise


def kept(folder: str) -> list[int]:
    location = checkpoint_location(folder, None)
    return [g for g in location.generations() if location.is_committed(g)]


def save_twice_resume_older(folder: str) -> list[float]:
    with session() as accelerator:
        bcp_accelerate.enable(accelerator, keep_generations=2)
        model, optimizer, scheduler = build(accelerator, seed=1)
        train(accelerator, model, optimizer, scheduler, range(2))
        steps = [accelerator.step]
        accelerator.save_state(folder)
        older = snapshot(accelerator, model, optimizer, scheduler)
        reference = train(accelerator, model, optimizer, scheduler, range(2, 4))
        steps.append(accelerator.step)
        accelerator.save_state(folder)
        generations = kept(folder)
        assert len(generations) == 2
        # Each generation records Accelerate's step counter (what its own save_state stores as "step").
        assert [open_checkpoint(folder, generation=g).manifest.step for g in generations] == steps
        # Each kept generation still has the sub-folder of accelerate's files it names.
        assert sum(name.startswith("accelerate-") for name in os.listdir(folder)) == 2
    with session("bcp") as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=2)
        scramble_rng()
        accelerator.load_state(folder, generation=generations[0])
        assert_restored(older, snapshot(accelerator, model, optimizer, scheduler))
        assert train(accelerator, model, optimizer, scheduler, range(2, 4)) == reference
    return reference


def test_load_state_resumes_from_an_older_kept_generation(ranks, tmp_path):
    losses = ranks(2).run(save_twice_resume_older, str(tmp_path / "state"))
    assert losses[0] == losses[1]


def keep_one(folder: str) -> str:
    with session() as accelerator:
        bcp_accelerate.enable(accelerator, keep_generations=1)
        model, optimizer, scheduler = build(accelerator, seed=1)
        accelerator.save_state(folder)
        first = kept(folder)
        accelerator.save_state(folder)
        assert len(kept(folder)) == 1
        assert sum(name.startswith("accelerate-") for name in os.listdir(folder)) == 1
        with pytest.raises(bcp.CheckpointNotFoundError) as missing:
            accelerator.load_state(folder, generation=first[0])
        return str(missing.value)


def test_a_generation_not_kept_is_a_clear_error(ranks, tmp_path):
    messages = ranks(2).run(keep_one, str(tmp_path / "state"))
    assert "committed generations kept are" in messages[0]


def test_keep_generations_must_be_positive():
    with session() as accelerator:
        with pytest.raises(bcp.CheckpointError, match="keep_generations must be an integer >= 1"):
            bcp_accelerate.enable(accelerator, keep_generations=0)


def save_incrementally(folder: str) -> dict:
    """Two saves into one folder with ``incremental=True``: the second writes the one tensor changed."""
    with session() as accelerator:
        bcp_accelerate.enable(accelerator, incremental=True)
        model, optimizer, scheduler = build(accelerator, seed=1)
        train(accelerator, model, optimizer, scheduler, range(2))
        accelerator.save_state(folder)
        with torch.no_grad():
            accelerator.unwrap_model(model).mlp.fc2.bias.add_(1)
        accelerator.save_state(folder)
        expected = snapshot(accelerator, model, optimizer, scheduler)
        newest = open_checkpoint(folder).manifest
    with session("bcp") as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=2)
        accelerator.load_state(folder)
        assert_bitwise(expected["tensors"], snapshot(accelerator, model, optimizer, scheduler)["tensors"])
    return {"version": newest.version, "earlier": sorted(newest.earlier_generations())}


def test_enable_incremental_writes_only_what_changed_into_a_folder_saved_again(ranks, tmp_path):
    for result in ranks(2).run(save_incrementally, str(tmp_path / "state")):
        assert result == {"version": 3, "earlier": [1]}
