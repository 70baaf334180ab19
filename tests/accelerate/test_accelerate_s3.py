"""``save_state``/``load_state`` to and from ``s3://`` (a real SeaweedFS) on 2 gloo processes: a
resume on 2 processes continues exactly as an uninterrupted run, one on 1 process reshards, and
automatic naming under an ``s3://`` project dir prunes to ``total_limit`` and resumes the newest."""

from __future__ import annotations

import contextlib
import math
import os
from typing import Iterator

from accelerate.utils import ProjectConfiguration

from accelerate_helpers import SAVED_AT, STEPS, build, load_on_one_process, resume_matches_uninterrupted, session, \
    snapshot, train
from bcp.engine.location import METRICS_DIR
from bcp.storage import storage_for


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """The AWS variables on a pool rank for the case's duration (the pool outlives the test)."""
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def save_after_training(url: str, env: dict[str, str]) -> dict:
    with environment(env), session("bcp") as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=1)
        train(accelerator, model, optimizer, scheduler, range(SAVED_AT))
        assert accelerator.save_state(url) == url
        return snapshot(accelerator, model, optimizer, scheduler)


def resume(url: str, saved: list[dict], env: dict[str, str]) -> None:
    with environment(env):
        resume_matches_uninterrupted(url, saved, False)


def resume_on_one(url: str, saved_rank0: dict, env: dict[str, str]) -> list[float]:
    with environment(env):
        return load_on_one_process(url, saved_rank0)


def test_save_state_to_s3_resumes_exactly_and_reshards(ranks, s3_env, s3_url):
    url = f"{s3_url}/ckpt"
    saved = ranks(2).run(save_after_training, url, s3_env)
    names = [name for name in storage_for(url).list_dir("") if name != METRICS_DIR]
    assert names[0].startswith("accelerate-") and names[1:] == ["gen-00000001"]
    assert {"scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"} <= set(storage_for(url).list_dir(names[0]))

    ranks(2).run(resume, url, saved, s3_env)
    losses = ranks(1).run(resume_on_one, url, saved[0], s3_env)[0]
    assert len(losses) == STEPS - SAVED_AT and all(math.isfinite(loss) for loss in losses)


def automatic_naming(project_dir: str, env: dict[str, str]) -> list[float]:
    config = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2)
    with environment(env), session("bcp", project_config=config) as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=1)
        for step in range(3):
            train(accelerator, model, optimizer, scheduler, range(step, step + 1))
            accelerator.save_state()
        expected = snapshot(accelerator, model, optimizer, scheduler)["tensors"]
    with environment(env), session("bcp", project_config=config) as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=2)
        accelerator.load_state()  # the newest: checkpoint_2
        assert accelerator.project_configuration.iteration == 3
        from models import assert_bitwise
        assert_bitwise(expected, snapshot(accelerator, model, optimizer, scheduler)["tensors"])
        return train(accelerator, model, optimizer, scheduler, range(3, 4))


def test_automatic_naming_under_an_s3_project_dir(ranks, s3_env, s3_url):
    ranks(2).run(automatic_naming, s3_url, s3_env)
    assert storage_for(f"{s3_url}/checkpoints").list_dir("") == ["checkpoint_1", "checkpoint_2"]
