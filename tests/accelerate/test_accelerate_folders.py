"""``ProjectConfiguration`` automatic naming on 2 processes: ``total_limit`` pruning only after the
new checkpoint is committed, interrupted saves neither counted nor resumed from, the iteration
counter right after a resume, and a run that switches from accelerate's engine to bcp."""

from __future__ import annotations

import os

import pytest
from accelerate.utils import ProjectConfiguration

from accelerate_helpers import assert_restored, build, scramble_rng, session, snapshot, train
from bcp_accelerate.folders import Contents, contents


def numbered(project_dir: str) -> dict[str, str]:
    root = os.path.join(project_dir, "checkpoints")
    return {name: contents(os.path.join(root, name)).name for name in sorted(os.listdir(root))}


def config(project_dir: str, total_limit: int | None = None) -> ProjectConfiguration:
    return ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=total_limit)


def save_failing_on_rank_1(accelerator) -> str:
    """A save whose pre-hook fails on rank 1: it stops before the commit, on both ranks."""

    def failing_hook(models, weights, output_dir):
        if accelerator.process_index == 1:
            raise RuntimeError("hook failed on purpose")

    handle = accelerator.register_save_state_pre_hook(failing_hook)
    try:
        with pytest.raises(Exception) as failure:
            accelerator.save_state()
    finally:
        handle.remove()
    return f"{type(failure.value).__name__}: {failure.value}"


def prune_after_commit_and_resume(project_dir: str) -> list[str]:
    with session("bcp", project_config=config(project_dir, total_limit=2)) as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=1)
        for step in range(3):
            train(accelerator, model, optimizer, scheduler, range(step, step + 1))
            accelerator.save_state()
        assert numbered(project_dir) == {"checkpoint_1": "COMMITTED", "checkpoint_2": "COMMITTED"}

        errors = [save_failing_on_rank_1(accelerator)]
        # Nothing was pruned for the save that never committed.
        assert numbered(project_dir) == {"checkpoint_1": "COMMITTED", "checkpoint_2": "COMMITTED",
                                         "checkpoint_3": "INCOMPLETE"}
        accelerator.save_state()  # the retry writes over the remains
        assert numbered(project_dir) == {"checkpoint_2": "COMMITTED", "checkpoint_3": "COMMITTED"}
        saved = snapshot(accelerator, model, optimizer, scheduler)
        errors.append(save_failing_on_rank_1(accelerator))

    with session("bcp", project_config=config(project_dir, total_limit=2)) as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=2)
        scramble_rng()
        accelerator.load_state()  # the newest committed one, not the interrupted checkpoint_4
        assert_restored(saved, snapshot(accelerator, model, optimizer, scheduler))
        assert accelerator.project_configuration.iteration == 5
        accelerator.save_state()
    assert numbered(project_dir) == {"checkpoint_3": "COMMITTED", "checkpoint_5": "COMMITTED"}
    return errors


def test_pruning_waits_for_the_commit_and_resume_skips_interrupted_saves(ranks, tmp_path):
    errors = ranks(2).run(prune_after_commit_and_resume, str(tmp_path / "project"))
    for rank_errors in errors:
        assert len(rank_errors) == 2 and rank_errors[0] == rank_errors[1]
    assert errors[1][0] == "RuntimeError: hook failed on purpose"
    assert errors[0][0].startswith("DistributedError: running the save_state pre-hooks failed on 1 of 2 rank(s): "
                                   "rank 1: RuntimeError: hook failed on purpose")


def switch_from_accelerate_engine(project_dir: str) -> None:
    with session(project_config=config(project_dir)) as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=1)
        train(accelerator, model, optimizer, scheduler, range(2))
        accelerator.save_state()
        saved = snapshot(accelerator, model, optimizer, scheduler)
    with session("bcp", project_config=config(project_dir)) as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=2)
        scramble_rng()
        accelerator.load_state()  # written by accelerate's engine: accelerate loads it
        assert_restored(saved, snapshot(accelerator, model, optimizer, scheduler))
        assert accelerator.project_configuration.iteration == 1
        train(accelerator, model, optimizer, scheduler, range(2, 3))
        accelerator.save_state()
        saved = snapshot(accelerator, model, optimizer, scheduler)
    with session("bcp", project_config=config(project_dir)) as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=3)
        scramble_rng()
        accelerator.load_state()
        assert_restored(saved, snapshot(accelerator, model, optimizer, scheduler))
    assert numbered(project_dir) == {"checkpoint_0": Contents.ACCELERATE.name, "checkpoint_1": "COMMITTED"}


def test_a_run_switches_from_accelerate_engine_to_bcp(ranks, tmp_path):
    ranks(2).run(switch_from_accelerate_engine, str(tmp_path / "project"))
