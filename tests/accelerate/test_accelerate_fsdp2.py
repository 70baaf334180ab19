"""FSDP2 prepared by accelerate itself (its FSDP2 path, run on gloo) on 2 processes, switched on
with ``bcp_accelerate.enable``: resumed on 2 FSDP2 processes exactly, and resharded onto 1."""

from __future__ import annotations

import bcp_accelerate
from accelerate_helpers import (
    SAVED_AT,
    build,
    load_on_one_process,
    resume_matches_uninterrupted,
    session,
    snapshot,
    train,
)


def save_fsdp2(path: str) -> dict:
    with session(fsdp2=True) as accelerator:
        bcp_accelerate.enable(accelerator)
        model, optimizer, scheduler = build(accelerator, seed=1)
        assert all(hasattr(p, "placements") for p in model.parameters())  # sharded DTensors
        train(accelerator, model, optimizer, scheduler, range(SAVED_AT))
        accelerator.save_state(path)
        return snapshot(accelerator, model, optimizer, scheduler)


def test_fsdp2_resumes_exactly_and_reshards_to_one_process(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = ranks(2).run(save_fsdp2, path)
    ranks(2).run(resume_matches_uninterrupted, path, saved, True)
    ranks(1).run(load_on_one_process, path, saved[0])
