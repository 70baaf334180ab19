"""DDP through a real Accelerator on 2 gloo processes: ``save_state`` with the environment flag,
``load_state`` on 2 processes (training continues exactly as without the interruption) and on 1
(resharded); and accelerate's own engine untouched while the flag is off."""

from __future__ import annotations

import math
import os

import accelerate
import pytest

import bcp_accelerate
from bcp.api.metrics import OpRecord
from bcp.api.metrics_log import read_records
from bcp.engine.location import METRICS_DIR
from accelerate_helpers import (
    SAVED_AT,
    Counter,
    STEPS,
    assert_restored,
    build,
    load_on_one_process,
    resume_matches_uninterrupted,
    scramble_rng,
    session,
    snapshot,
    train,
)
from models import rank


def save_after_training(path: str) -> dict:
    with session("bcp") as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=1)
        train(accelerator, model, optimizer, scheduler, range(SAVED_AT))
        accelerator.save_state(path)
        return snapshot(accelerator, model, optimizer, scheduler)


@pytest.fixture(scope="module")
def ddp_checkpoint(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("accelerate-ddp") / "ckpt")
    return path, ranks(2).run(save_after_training, path)


def test_bcp_checkpoint_replaces_accelerate_files(ddp_checkpoint):
    path, _ = ddp_checkpoint
    names = sorted(os.listdir(path))
    assert names[0].startswith("accelerate-") and names[1:] == [METRICS_DIR, "gen-00000001"]
    assert {"scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"} <= set(os.listdir(f"{path}/{names[0]}"))


def load_state_on_each_process(path: str) -> int:
    with session("bcp") as accelerator:
        build(accelerator, seed=2)
        accelerator.load_state(path)
        return accelerator.process_index


def test_metrics_records_carry_the_process_index(ranks, ddp_checkpoint):
    path, _ = ddp_checkpoint
    loads_before = [r for r in read_records(path) if r["op"] == "load"]
    assert ranks(2).run(load_state_on_each_process, path) == [0, 1]
    saves, loads = ([OpRecord.from_json(r) for r in read_records(path) if r["op"] == op] for op in ("save", "load"))
    assert len(loads) == len(loads_before) + 1  # load_state's read of its own record is not an operation
    for record in (saves[0], loads[-1]):
        assert [(r.rank, r.topology) for r in record.ranks] == [(0, {"dp": 0}), (1, {"dp": 1})]


def test_ddp_resume_on_two_processes_continues_exactly(ranks, ddp_checkpoint):
    path, saved = ddp_checkpoint
    ranks(2).run(resume_matches_uninterrupted, path, saved, False)


def test_ddp_two_processes_to_one(ranks, ddp_checkpoint):
    path, saved = ddp_checkpoint
    losses = ranks(1).run(load_on_one_process, path, saved[0])[0]
    assert len(losses) == STEPS - SAVED_AT and all(math.isfinite(loss) for loss in losses)


def load_on_more_processes(path: str, saved_rank0: dict) -> None:
    with session("bcp") as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=2)
        scramble_rng()
        accelerator.load_state(path)
        restored = snapshot(accelerator, model, optimizer, scheduler)
        if rank() > 0:  # no RNG state was saved for this process: accelerate leaves it as it is
            restored["rng"] = saved_rank0["rng"]
        assert_restored(saved_rank0, restored)
        train(accelerator, model, optimizer, scheduler, range(SAVED_AT, STEPS))


def test_ddp_one_process_to_two(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = ranks(1).run(save_after_training, path)[0]
    ranks(2).run(load_on_more_processes, path, saved)


def accelerate_own_engine(path: str, kill_switch_path: str) -> None:
    assert getattr(accelerate.Accelerator.save_state, "__wrapped__", None) is not None  # bcp_accelerate installed
    with session() as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=1)
        train(accelerator, model, optimizer, scheduler, range(2))
        accelerator.save_state(path)
        saved = snapshot(accelerator, model, optimizer, scheduler)
    with session() as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=2)
        scramble_rng()
        accelerator.load_state(path)
        assert_restored(saved, snapshot(accelerator, model, optimizer, scheduler))
    # ACCELERATE_CHECKPOINT_ENGINE=accelerate overrides an opt-in in the code.
    with session("accelerate") as accelerator:
        bcp_accelerate.enable(accelerator)
        assert not bcp_accelerate.uses_bcp(accelerator)
        build(accelerator, seed=1)
        accelerator.save_state(kill_switch_path)


def test_without_the_flag_accelerate_saves_and_loads_as_before(ranks, tmp_path):
    path, kill_switch_path = str(tmp_path / "plain"), str(tmp_path / "kill-switch")
    ranks(2).run(accelerate_own_engine, path, kill_switch_path)
    accelerate_files = {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                        "random_states_1.pkl"}
    assert set(os.listdir(path)) == accelerate_files
    assert set(os.listdir(kill_switch_path)) == accelerate_files


def save_with_both_engines(accelerate_path: str, bcp_path: str) -> None:
    for engine, path in ((None, accelerate_path), ("bcp", bcp_path)):
        with session(engine) as accelerator:
            accelerator.register_for_checkpointing(Counter(3))
            build(accelerator, seed=1)
            accelerator.save_state(path)


def test_accelerate_writes_the_same_files_besides_models_optimizers_and_custom_objects(ranks, tmp_path):
    accelerate_path, bcp_path = tmp_path / "accelerate", tmp_path / "bcp"
    ranks(2).run(save_with_both_engines, str(accelerate_path), str(bcp_path))
    [files_dir] = [p for p in bcp_path.iterdir() if p.name.startswith("accelerate-")]
    # the registered object is in the bcp checkpoint (safe encoding), not in accelerate's pickle
    assert {p.name for p in files_dir.iterdir()} == {p.name for p in accelerate_path.iterdir()} - {
        "model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl"}
