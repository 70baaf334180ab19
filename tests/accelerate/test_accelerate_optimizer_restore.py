"""``save_state`` right after ``prepare`` (the optimizer never stepped), train, ``load_state`` of
that first checkpoint: the optimizer comes back empty, as with accelerate's own engine, and training
goes on exactly as a fresh run's. The defect: the load failed, reporting the state created since
(exp_avg, exp_avg_sq, step) as missing from the checkpoint."""

from __future__ import annotations

import pytest
from accelerate_helpers import build, session, train

from models import assert_bitwise, full_state


def save_train_load(path: str, safe_serialization: bool) -> None:
    with session() as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=1)
        reference = train(accelerator, model, optimizer, scheduler, range(2))
        fresh = full_state(model, optimizer)
    with session("bcp") as accelerator:
        model, optimizer, scheduler = build(accelerator, seed=1)
        accelerator.save_state(path, safe_serialization=safe_serialization)
        train(accelerator, model, optimizer, scheduler, range(3))
        accelerator.load_state(path)
        assert not any(optimizer.optimizer.state.values())
        assert [g["lr"] for g in optimizer.param_groups] == [1e-2]
        assert train(accelerator, model, optimizer, scheduler, range(2)) == reference
        assert_bitwise(fresh, full_state(model, optimizer))


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_a_checkpoint_saved_before_any_step_loads_an_empty_optimizer(ranks, tmp_path, safe_serialization):
    ranks(1).run(save_train_load, str(tmp_path / "ckpt"), safe_serialization)
